"""Quantized samplers, declared: how a sampler holds its weights, activations and KV cache below 16 bits, one file
each in this folder (``@register_sampler("name")`` on a function returning a `Quantization`, its keyword arguments
its own settings, checked from the signature as recipes and predictors are), applied at the points lab/rl/paths.py
defines, over a 16-bit sampler path.

A mode's sampler is a format (``sampler: bf16``: the plain inference-engine path, as ever) or a mapping:

    sampler: {path: bf16, quant: fp8-blockwise, kv: current, head_fp32: true, source: copy, fuse: [head]}

``path``: the 16-bit (or FP32) engine path under the quantization; ``quant``: a declaration's name, or
``{name: ..., settings}`` / ``"name:key=value"``; and, overriding what the declaration says: ``kv`` (the KV cache in
FP8 E4M3 with its delayed scale: null (not quantized), fixed (the first rollout's calibration, kept), current
(recalibrated each rollout: each policy update, as FP8-RL does) or {predictor: SPEC} (a lab predictor,
lab/scaling/predictors, over the earlier rollouts' calibrations)); ``head_fp32`` (TRL's cast_lm_head_to_fp32);
``source`` (the weights quantized from the FP32 master or from the path's 16-bit copy); ``fuse`` (the engine's fused
regions, lab/rl/paths.py). ``quant: none`` quantizes nothing: the path with only those overrides (one factor at a
time).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from lab.core.errors import ConfigError, did_you_mean
from lab.core.settings import check_settings, declared_settings, parse_spec
from lab.formats import IntFormat, OperandFormat, quantize
from lab.formats.scaled import delayed_amax
from lab.rl import paths

__all__ = ["Quantization", "KVScales", "register_sampler", "create_quantization", "sampler_path", "check_sampler",
           "available", "SAMPLERS", "SOURCES", "KV_RULES"]

SOURCES = ("master", "copy")
KV_RULES = ("fixed", "current")  # or {predictor: SPEC}
#: the KV cache's format: FP8 E4M3, one delayed scale per layer for K and one for V (vLLM's k_scale, v_scale)
KV_FORMAT = OperandFormat("e4m3", "tensor", scale="delayed")
SAMPLER_KEYS = ("path", "quant", "kv", "head_fp32", "source", "fuse")


@dataclass(frozen=True)
class Quantization:
    """A quantized sampler: ``weights`` (each block's linears; None: kept in the path's format), ``activations``
    (the inputs of those linears: W8A8; None: weights-only), ``kv`` (the KV cache's scale rule: None, "fixed",
    "current" or {"predictor": spec}), ``head_fp32``, ``source`` (master | copy) and where it comes from."""
    name: str
    weights: OperandFormat | IntFormat | None
    activations: OperandFormat | IntFormat | None = None
    kv: str | dict | None = None
    head_fp32: bool = False
    source: str = "master"
    origin: str = ""

    def __post_init__(self):
        if self.activations is not None and self.weights is None:
            raise ConfigError(f"sampler quant {self.name!r}: quantized activations need quantized weights (W8A8)")
        if self.source not in SOURCES:
            raise ConfigError(f"sampler quant {self.name!r}: source must be one of {', '.join(SOURCES)}, got "
                              f"{self.source!r}")
        check_kv(self.kv, f"sampler quant {self.name!r}")


def check_kv(kv, where: str) -> None:
    if kv is None or kv in KV_RULES:
        return
    if isinstance(kv, dict) and set(kv) == {"predictor"}:
        from lab.scaling.predictors import create_predictor
        create_predictor(kv["predictor"])  # its ConfigError names what is wrong
        return
    raise ConfigError(f"{where}: kv must be null, {' or '.join(KV_RULES)} or {{predictor: SPEC}}, got {kv!r}")


class KVScales:
    """The KV cache's delayed scales, one per layer for K and for V, kept over a run's rollouts: each rollout's
    calibration (its prompts' prefill amax, paths.calibrate_kv) gives this rollout's amax by the rule: fixed (the
    first calibration, kept), current (its own), {predictor: spec} (the predictor over the earlier calibrations,
    most recent first, as lab.formats.scaled.delayed_amax takes a prediction; the first rollout its own)."""

    def __init__(self, rule, history_len: int = 16):
        self.rule, self.history_len = rule, history_len
        self.predictor = None
        if isinstance(rule, dict):
            from lab.scaling.predictors import create_predictor
            self.predictor = create_predictor(rule["predictor"])
        self.amax = None     # (layers, 2): this rollout's K and V amax, what their scales come from
        self.history = None  # (layers, 2, n) the calibrations so far, most recent first

    def calibrate(self, measured: torch.Tensor) -> None:
        measured = measured.detach().float()
        if self.amax is None or self.rule == "current":
            amax = measured
        elif self.rule == "fixed":
            amax = self.amax
        else:
            amax = delayed_amax(self.predictor(self.history), self.amax)
        self.amax = amax
        self.history = measured[..., None] if self.history is None else torch.cat(
            [measured[..., None], self.history], dim=-1)[..., :self.history_len]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as the cache stores them: FP8 E4M3 at this rollout's scale (dequantized, FP32)."""
        if self.amax is None:
            raise ValueError("the KV cache's scales are not calibrated yet (paths.calibrate_kv before a forward)")
        return tuple(quantize(t, KV_FORMAT, k_dim=-1, history_amax=self.amax[layer, j]).values
                     for j, t in enumerate((k, v)))


SAMPLERS: dict = {}


def register_sampler(name: str):
    """Register a function that returns a Quantization (its keyword arguments: the declaration's settings)."""
    def wrap(fn):
        if name in SAMPLERS and SAMPLERS[name] is not fn:
            raise ValueError(f"sampler quant {name!r} is already registered (by {SAMPLERS[name].__module__})")
        SAMPLERS[name] = fn
        return fn
    return wrap


def _load() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def available() -> list[str]:
    _load()
    return sorted(SAMPLERS)


def overrides(kv: Annotated[str | dict | None, "the KV cache: null, fixed, current or {predictor: SPEC}"] = None,
              head_fp32: Annotated[bool, "the head in FP32 (TRL's cast_lm_head_to_fp32)"] = False,
              source: Annotated[Literal[SOURCES], "weights quantized from the FP32 master or the 16-bit copy"
                                ] = "master"):
    """What a sampler line may set over its declaration (declared for check_settings)."""


def create_quantization(spec, **given) -> Quantization:
    """A Quantization from a declaration's spec (a name, ``"name:key=value"`` or {name: ..., settings}), its
    settings checked against the declaration's signature, then ``given`` (kv, head_fp32, source) over it."""
    _load()
    name, params = parse_spec(spec, "sampler quant")
    if name not in SAMPLERS:
        raise ConfigError(f"unknown sampler quant {name!r}{did_you_mean(str(name), SAMPLERS)}; known: "
                          f"{', '.join(sorted(SAMPLERS))}")
    check_settings(f"sampler quant {name!r}", declared_settings(SAMPLERS[name])[0], params)
    q = SAMPLERS[name](**params)
    return dataclasses.replace(q, **given)


def _line(spec, where: str) -> dict:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: a sampler is one of {', '.join(paths.FORMATS)} or a mapping of "
                          f"{', '.join(SAMPLER_KEYS)}, got {spec!r}")
    unknown = set(spec) - set(SAMPLER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown sampler key(s) {sorted(unknown)}; expected {', '.join(SAMPLER_KEYS)}")
    if spec.get("path", "bf16") not in paths.FORMATS:
        raise ConfigError(f"{where}: sampler path must be one of {', '.join(paths.FORMATS)}, got {spec['path']!r}")
    given = {k: spec[k] for k in ("kv", "head_fp32", "source") if k in spec}
    check_settings(f"{where}: sampler", declared_settings(overrides)[0], given)
    return given


def check_sampler(spec, where: str = "sampler") -> None:
    """A mode's sampler line checked (ConfigError naming what is wrong), nothing built beyond its declaration."""
    if isinstance(spec, str) and spec in paths.FORMATS:
        return
    sampler_path(spec, where=where)


def sampler_path(spec, fuse: tuple = (), where: str = "sampler") -> paths.Rounding:
    """The sampler's path for a mode's ``sampler``: a format (paths.engine(fmt, fuse), exactly as ever) or a
    mapping (module docstring). A KV cache's scales live in the returned path: build it once per run."""
    if isinstance(spec, str) and spec in paths.FORMATS:
        return paths.engine(spec, fuse)
    given = _line(spec, where)
    fmt = spec.get("path", "bf16")
    try:
        q = create_quantization(spec.get("quant", "none"), **given)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if q.source == "copy" and fmt == "fp32":
        raise ConfigError(f"{where}: source copy quantizes the path's 16-bit copy; path fp32 has none")
    rd = paths.engine(fmt, tuple(spec.get("fuse", fuse)))
    kv = KVScales(q.kv) if q.kv is not None else None
    return dataclasses.replace(rd, quant=q, kv_scales=kv)

"""Predictors of a tensor's next amax from its history: the rule behind every scale that looks ahead.

A delayed scale (Transformer Engine's `DelayedScaling`, the lab's `fp8-delayed` recipe, FP16's `amax-predicted`
policy) is `max_value / predicted_amax / 2^margin`: everything it gets right or wrong is the prediction. A predictor
reads a history of amaxes (most recent first; 0 where nothing was observed yet, as TE's history starts) and returns
the amax it expects the next step to reach. An entry is observed when it is finite and positive: 0 (not yet, an
all-zero tensor), inf and NaN (a step that overflowed upstream) say nothing about the next amax and are skipped, so
that one of them neither poisons a window nor stands in for the latest amax. Whatever the history, the prediction is
finite: at least FP32's smallest subnormal and at most its largest value where any entry is observed, 0 where none
is (the caller then keeps its previous scale, as TE does).

One file each in this folder, registered by name, as timm registers models: `@register_predictor("name")` on a
`Predictor` subclass whose keyword arguments are its settings (type- and range-checked from the signature, with
did-you-mean for a misspelt one). A new predictor is that file and one config line (`algorithm: {name: mine}` in an
`fp8-delayed` recipe, `predictor: mine` in `amax-predicted`); `lab replay RUN` lists it.

The prediction runs on the history's device in a few tensor operations: no host synchronisation, batched over any
leading dimensions (an FP8 layer's three roles at once). docs/controllers.md says how each one predicts and fails.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from lab.core.errors import ConfigError, did_you_mean
from lab.core.settings import check_settings, declared_settings

__all__ = ["Predictor", "register_predictor", "create_predictor", "available_predictors", "parse_spec",
           "spec_string", "latest_observed", "PREDICTORS"]

PREDICTORS: dict[str, type] = {}
#: which history a predictor reads: the optimizer's gradients' amax per step (FP16 loss scaling), or one quantized
#: tensor's amax per step (an FP8 linear's input, weight or output gradient)
HISTORIES = ("fp16", "fp8")


class Predictor:
    """Predicts the next amax of each history. Subclass it, take settings as keyword arguments of ``__init__``
    (annotated int, float, str, bool or Literal, a range as ``Annotated[float, Range(ge=0)]``:
    ``create_predictor`` checks them, lab/core/settings.py), and implement ``predict``."""

    name: str | None = None  # filled in by @register_predictor
    history: str = "fp8"     # which kind of history it reads (HISTORIES), set by create_predictor
    #: an inf amax in the window leaves no prediction (0: the caller keeps its scale) for as long as it stays there:
    #: Transformer Engine's `max`, whose maximum is then inf and whose scale stays where it was (delayed_scaling.cu)
    inf_keeps_scale: bool = False

    def predict(self, amax, observed):
        """amax: (..., n) of the history's dtype, most recent first, finite and positive where ``observed`` (its
        bool mask, at least one True in every history) and 1.0 elsewhere. Returns (...) the predicted amax."""
        raise NotImplementedError

    def __call__(self, history):
        """history (..., n), most recent first: the predicted next amax from its observed (finite, positive)
        entries, in [FP32's smallest subnormal, FP32's largest value]; 0 where it holds no observation (the
        caller keeps its scale: TE's 1 at the start), and where an inf is in it for a predictor that
        ``inf_keeps_scale``."""
        import torch
        observed = torch.isfinite(history) & (history > 0)
        any_seen = observed.any(-1)
        usable = any_seen & ~torch.isposinf(history).any(-1) if self.inf_keeps_scale else any_seen
        amax = torch.where(observed, history, torch.ones_like(history))
        # a history without an observation predicts from a stand-in 1.0 (no 0/0 on the way) and is answered 0 below
        first = ~observed.any(-1, keepdim=True) & (torch.arange(history.shape[-1], device=history.device) == 0)
        pred = self.predict(amax, observed | first)
        # an extrapolation past FP32's range (a history near 2^128 rising, one falling towards 2^-149) is an amax
        # no FP32 tensor can have: its bound instead, never inf, never 0 where something was observed
        fp32 = torch.finfo(torch.float32)  # the amaxes are of FP32 or narrower tensors
        pred = pred.clamp(min=fp32.tiny * fp32.eps, max=fp32.max)
        return torch.where(usable, pred, torch.zeros_like(pred))

    def settings(self) -> dict[str, Any]:
        names = inspect.signature(type(self).__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self" and hasattr(self, k)}

    def _err(self, msg: str) -> ConfigError:
        return ConfigError(f"predictor {self.name!r}: {msg}")

    def __repr__(self) -> str:
        return spec_string(self.name, self.settings())


def latest_observed(observed):
    """(..., 1) int64: the position of each history's most recent observed entry (0 where none is), from its bool
    mask (..., n), most recent first. argmax returns the first of equal maxima."""
    import torch
    return observed.to(torch.uint8).argmax(-1, keepdim=True)


def register_predictor(name: str):
    """Register a Predictor subclass under ``name`` (one file in lab/scaling/predictors/)."""
    def wrap(cls):
        if name in PREDICTORS and PREDICTORS[name] is not cls:
            raise ValueError(f"predictor {name!r} is already registered (by {PREDICTORS[name].__module__})")
        cls.name = name
        PREDICTORS[name] = cls
        return cls
    return wrap


def _load() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def available_predictors() -> list[str]:
    _load()
    return sorted(PREDICTORS)


def parse_spec(spec) -> tuple[str, dict]:
    """A predictor spec as (name, settings): ``"ema"``, ``"ema:k=2,decay=0.8"`` (values read as YAML) or
    ``{"name": "ema", "k": 2}`` (lab.core.settings.parse_spec)."""
    from lab.core.settings import parse_spec as parse
    return parse(spec, "predictor")


def spec_string(name: str, settings: dict) -> str:
    """The canonical text of a predictor spec: ``name`` or ``name:key=value,...`` (sorted keys)."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in sorted(settings.items())) if settings else "")


def create_predictor(spec, history: str = "fp8") -> Predictor:
    """A Predictor from a spec (``parse_spec``) for a history kind (HISTORIES): unknown names and settings, wrong
    types and values raise ConfigError naming what is allowed."""
    if history not in HISTORIES:
        raise ConfigError(f"history must be one of {', '.join(HISTORIES)}, got {history!r}")
    _load()
    name, params = parse_spec(spec)
    if name not in PREDICTORS:
        raise ConfigError(f"unknown predictor {name!r}{did_you_mean(name, PREDICTORS)}; known: "
                          f"{', '.join(sorted(PREDICTORS))}")
    cls = PREDICTORS[name]
    check_settings(f"predictor {name!r}", declared_settings(cls)[0], params)
    obj = cls.__new__(cls)
    obj.history = history
    obj.__init__(**params)
    return obj

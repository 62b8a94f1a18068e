"""Predictors of a tensor's next amax from its history: the rule behind every scale that looks ahead.

A delayed scale (Transformer Engine's `DelayedScaling`, the lab's `fp8-delayed` recipe, FP16's `amax-predicted`
policy) is `max_value / predicted_amax / 2^margin`: everything it gets right or wrong is the prediction. A predictor
reads a history of amaxes (most recent first; 0 where nothing was observed yet, as TE's history starts) and returns
the amax it expects the next step to reach. One file each in this folder, registered by name, as timm registers
models: `@register_predictor("name")` on a `Predictor` subclass whose keyword arguments are its settings (type- and
range-checked from the signature, with did-you-mean for a misspelt one). A new predictor is that file and one
config line (`algorithm: {name: mine}` in an `fp8-delayed` recipe, `predictor: mine` in `amax-predicted`);
`lab replay RUN` lists it.

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
           "spec_string", "PREDICTORS"]

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

    def predict(self, amax, observed):
        """amax: (..., n) FP32, most recent first, 1.0 where nothing was observed; observed: its bool mask (at
        least one True where any is). Returns (...) the predicted amax."""
        raise NotImplementedError

    def __call__(self, history):
        """history (..., n), most recent first, 0 (or NaN) where nothing was observed: the predicted next amax,
        0 where the history holds no observation (the caller's initial scale: TE's 1)."""
        import torch
        observed = history > 0  # NaN compares False: unobserved
        any_seen = observed.any(-1)
        amax = torch.where(observed, history, torch.ones_like(history))
        first = ~observed.any(-1, keepdim=True) & (torch.arange(history.shape[-1], device=history.device) == 0)
        pred = self.predict(amax, observed | first)
        return torch.where(any_seen, pred, torch.zeros_like(pred))

    def settings(self) -> dict[str, Any]:
        names = inspect.signature(type(self).__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self" and hasattr(self, k)}

    def _err(self, msg: str) -> ConfigError:
        return ConfigError(f"predictor {self.name!r}: {msg}")

    def __repr__(self) -> str:
        return spec_string(self.name, self.settings())


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

"""Loss-scaling policies behind one ``torch.amp.GradScaler``-compatible engine.

Usage::

    import lab, lab.scaling

    scaler = lab.scaling.create("dynamic", growth_interval=1000, fp32_fallback_after=10)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad(set_to_none=True)
        with lab.autocast(device, torch.float16, enabled=not scaler.fp32_fallback):  # "cpu" or "cuda"
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                      # optional: clip unscaled gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped:          # don't advance the schedule on skipped steps
            sched.step()

Policies: ``lab.scaling.available()``. Add one with ``@lab.scaling.register("name")`` on a
:class:`ScalingPolicy` subclass (see its docstring).

The package: base.py (the policy interface and registry), engine.py (the engine), counters.py (its counters and
guards), policies/ (every policy, one file each, the shipped ones and users' alike: every module there is imported
when this package loads; policies/__init__.py lists them) and adapters.py (``check_trainable_dtypes``: FP16
trainable parameters, e.g. LoRA adapters, refused before the first step). Imports no other lab package but
lab.core.fp16 (FP16's bounds) and lab.core.settings (a policy's settings checked against its signature, as a
recipe's and a predictor's are). Importing it, the registry and ``check`` need no torch: the engine and the adapter
check load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (ENGINE_PARAMS, ScalingConfigError, ScalingPolicy, available, check_engine_params, fp32_mul,
                   get_policy_class, kernel_mul, policy_params, register, to_f32)
# after the names above: a policy file may import them from lab.scaling (docs/policies.md, "Example: bounded")
from . import policies as _policies  # noqa: F401  (registers every policy in policies/)
from lab.core.settings import check_settings, declared_settings

if TYPE_CHECKING:
    from .engine import LossScaler

# The engine and the adapter check need torch; the registry, the policies and their checks do not, so a process
# that only validates a study (Snakemake's, when it reads the Snakefile) never imports torch (~4 s here).
_LAZY = {"LossScaler": ".engine", "COUNTER_KEYS": ".engine", "FP16_TRAINABLE_FIX": ".adapters",
         "TrainableDtypeError": ".adapters", "check_trainable_dtypes": ".adapters"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = ["create", "check", "register", "available", "accepted_params", "ScalingPolicy", "LossScaler",
           "ScalingConfigError", "ENGINE_PARAMS", "COUNTER_KEYS", "get_policy_class",
           "to_f32", "kernel_mul", "fp32_mul", "check_trainable_dtypes", "TrainableDtypeError",
           "FP16_TRAINABLE_FIX"]


def accepted_params(name: str) -> dict[str, list[str]]:
    """``{"policy": [...], "engine": [...]}``: the keyword arguments ``create(name, ...)`` accepts."""
    names, _ = policy_params(get_policy_class(name))
    return {"policy": names, "engine": list(ENGINE_PARAMS)}


def check(name: str, **params: Any) -> ScalingPolicy:
    """The policy ``create(name, **params)`` would run, built and checked, and the engine's parameters checked
    (all but the device), without the engine: what a study's validation needs, without importing torch."""
    cls = get_policy_class(name)
    declared, var_kw = declared_settings(cls)
    # the engine's own parameters are named beside the policy's (check_engine_params checks their values)
    check_settings(f"policy {name!r}", {**declared, **dict.fromkeys(ENGINE_PARAMS, Any)}, params,
                   error=ScalingConfigError, var_kw=var_kw)
    engine_kw = {k: params.pop(k) for k in ENGINE_PARAMS if k in params}
    names, _ = policy_params(cls)
    try:
        policy = cls(**params)
    except TypeError as exc:  # e.g. a required parameter is missing
        raise ScalingConfigError(
            f"cannot build loss-scaling policy {name!r}: {exc}; "
            f"policy parameters: {', '.join(names) if names else '(none)'}") from exc
    check_engine_params(**engine_kw)
    return policy


def create(name: str, **params: Any) -> LossScaler:
    """Build a scaler running policy ``name``.

    ``params`` are the policy's parameters plus the engine's: ``enabled=True``,
    ``device=None`` ("cuda" if available else "cpu"), ``alert_after=3``, ``fp32_fallback_after=None``.
    Unknown names or parameters and invalid values raise :class:`ScalingConfigError` (a ValueError).
    """
    from .engine import LossScaler
    engine_kw = {k: params[k] for k in ENGINE_PARAMS if k in params}
    return LossScaler(check(name, **params), **engine_kw)

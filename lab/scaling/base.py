"""Policy base class, policy registry and FP32 rounding helpers.

A *policy* only decides the next loss scale from one step's outcome; the shared
engine (:mod:`lab.scaling.engine`) does everything else (scaling, fused
unscale + inf/nan check, skipping, counters, guards, host synchronisation).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, TypeVar

import numpy as np

__all__ = [
    "ScalingConfigError",
    "ScalingPolicy",
    "register",
    "available",
    "get_policy_class",
    "policy_params",
    "to_f32",
    "kernel_mul",
    "fp32_mul",
]


class ScalingConfigError(ValueError, AssertionError):
    """Invalid scaler configuration.

    A ``ValueError`` (what the lab promises) that is also an ``AssertionError``,
    because ``torch.amp.GradScaler`` and Megatron-LM report bad factors with
    ``AssertionError``: code written against either keeps working.
    """


# --------------------------------------------------------------------------- FP32 helpers
# Smallest magnitude that rounds to infinity in binary32 (halfway between FLT_MAX and 2**128,
# ties-to-even goes up to 2**128 i.e. inf).
_F32_OVERFLOW = 2.0**128 - 2.0**103


def to_f32(x: float) -> float:
    """Round a Python float to the nearest binary32 value (IEEE round-to-nearest-even).

    Overflow gives +-inf (without numpy's RuntimeWarning), NaN stays NaN.
    """
    x = float(x)
    if abs(x) >= _F32_OVERFLOW and not math.isinf(x):
        return math.copysign(math.inf, x)
    return float(np.float32(x))


def kernel_mul(scale: float, factor: float) -> float:
    """``scale * factor`` rounded exactly as PyTorch's ``_amp_update_scale_`` kernels do it.

    The CPU and CUDA kernels multiply the float32 scale by the *double* factor in double precision
    and round the product to float32 once.  (Multiplying by ``float32(factor)`` in FP32 instead gives
    a different result for roughly a quarter of non-power-of-two factors.)
    """
    return to_f32(scale * factor)


def fp32_mul(scale: float, factor: float) -> float:
    """Pure FP32 product ``float32(scale) * float32(factor)`` (what FP32 torch tensors compute).

    The double product of two binary32 values is exact, so one rounding gives the IEEE FP32 result.
    """
    return to_f32(to_f32(scale) * to_f32(factor))


# --------------------------------------------------------------------------- base class
class ScalingPolicy:
    """Decides the next loss scale from the outcome of one optimiser step.

    Subclass it, take your parameters as keyword arguments of ``__init__`` (they become the
    parameters ``lab.scaling.create(name, **params)`` accepts) and implement :meth:`update`.
    Everything else -- scaling the loss, the fused unscale + inf/nan check, skipping steps,
    counters, guards, state_dict -- is done by the engine. A complete user policy::

        # my_policy.py
        from lab.scaling import ScalingPolicy, register

        @register("halving")
        class Halving(ScalingPolicy):
            '''Start at init_scale, halve on every overflow, never grow.'''

            def __init__(self, init_scale: float = 1024.0):
                self.init_scale = self.check_positive("init_scale", init_scale)

            def update(self, scale, found_inf, step, grad_norm=None):
                return scale * 0.5 if found_inf else scale

        # elsewhere:  scaler = lab.scaling.create("halving", init_scale=512.0)

    Class attributes a policy may override:

    * ``init_scale`` -- the scale before the first update (instances usually set it).
    * ``skip_on_overflow`` -- skip ``optimizer.step()`` when its gradients hold inf/nan (default True).
    * ``needs_grad_norm`` -- if True the engine computes the unscaled global L2 gradient norm on
      the device during ``unscale_`` and fetches it with the inf/nan flag in the same host sync;
      ``update`` then receives it as ``grad_norm`` (inf/nan when the step overflowed).
    * ``needs_grad_amax`` -- if True the engine also computes the unscaled gradients' largest absolute value
      (one reduction per gradient, fetched in the same host sync) and ``update`` receives it as the keyword
      ``grad_amax`` (inf when the step overflowed; see ``lab.scaling.policies.amax``).

    ``update`` receives the current scale (a Python float holding an FP32 value), whether any
    optimiser found inf/nan this step, the 0-based index of this ``update()`` call and the grad norm
    (or None). It returns the next scale; the engine rounds it to FP32 and stores it on the device.
    Keep mutable state (trackers) in attributes and return it from :meth:`state_dict`.
    """

    name: str | None = None  # filled in by @register
    init_scale: float = 2.0**16
    skip_on_overflow: bool = True
    needs_grad_norm: bool = False
    needs_grad_amax: bool = False

    def update(self, scale: float, found_inf: bool, step: int, grad_norm: float | None = None) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Mutable policy state (not the scale, which the engine saves). Plain Python values."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ``state`` may hold extra engine keys."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} init_scale={self.init_scale!r}>"

    # ---- validation helpers (raise ScalingConfigError, a ValueError) ----
    def _err(self, msg: str) -> ScalingConfigError:
        return ScalingConfigError(f"policy {self.name!r}: {msg}")

    def check_number(self, pname: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise self._err(f"{pname} must be a real number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise self._err(f"{pname} must be finite, got {value!r}")
        return value

    def check_positive(self, pname: str, value: Any) -> float:
        value = self.check_number(pname, value)
        if value <= 0.0:
            raise self._err(f"{pname} must be > 0, got {value!r}")
        return value

    def check_factors(self, growth_factor: Any, backoff_factor: Any) -> tuple[float, float]:
        """Growth factor > 1 and backoff factor in (0, 1), the rule every growing/backing-off policy shares."""
        growth_factor = self.check_number("growth_factor", growth_factor)
        if growth_factor <= 1.0:
            raise self._err(f"growth_factor must be > 1.0, got {growth_factor!r}")
        backoff_factor = self.check_number("backoff_factor", backoff_factor)
        if not 0.0 < backoff_factor < 1.0:
            raise self._err(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        return growth_factor, backoff_factor

    def check_int(self, pname: str, value: Any, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self._err(f"{pname} must be an int, got {value!r}")
        if value < minimum:
            raise self._err(f"{pname} must be >= {minimum}, got {value!r}")
        return int(value)


# --------------------------------------------------------------------------- registry
_REGISTRY: dict[str, type[ScalingPolicy]] = {}

P = TypeVar("P", bound=type)


def register(name: str) -> Callable[[P], P]:
    """Class decorator that adds a :class:`ScalingPolicy` subclass under ``name``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ScalingPolicy)):
            raise TypeError(f"@register({name!r}) expects a ScalingPolicy subclass, got {cls!r}")
        if cls.update is ScalingPolicy.update:
            raise TypeError(f"policy {name!r} ({cls.__name__}) must implement update()")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"policy name {name!r} is already registered by {old.__module__}.{old.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    """Sorted names of the registered policies."""
    return sorted(_REGISTRY)


def get_policy_class(name: str) -> type[ScalingPolicy]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown loss-scaling policy {name!r}; available: {', '.join(available())}"
        ) from None


def policy_params(cls: type[ScalingPolicy]) -> tuple[list[str], bool]:
    """(keyword parameter names of ``cls.__init__``, whether it takes ``**kwargs``)."""
    names: list[str] = []
    var_kw = False
    if cls.__init__ is object.__init__:
        return names, var_kw
    for i, p in enumerate(inspect.signature(cls.__init__).parameters.values()):
        if i == 0:
            continue  # self
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return sorted(names), var_kw


#: the engine's keyword arguments (lab.scaling.create takes them beside the policy's)
ENGINE_PARAMS = ("alert_after", "device", "enabled", "fp32_fallback_after", "per_tensor")
#: per_tensor's settings and their defaults (lab/scaling/pertensor.py)
#: predictor: each block's next maximum from its history (lab/scaling/predictors; max: amax-history's rule)
PER_TENSOR_DEFAULTS = {"history": 16, "margin": 3, "boundaries": None, "predictor": "max"}


def check_engine_params(enabled: bool = True, alert_after: int | None = 3,
                        fp32_fallback_after: int | None = None, per_tensor: Any = None, **_device) -> None:
    """The engine's checks that need no torch (LossScaler checks the device itself): a study config is validated
    with them before any job, in a process (Snakemake's) that need not import torch."""
    if not isinstance(enabled, bool):
        raise ScalingConfigError(f"enabled must be a bool, got {enabled!r}")
    for pname, val in (("alert_after", alert_after), ("fp32_fallback_after", fp32_fallback_after)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ScalingConfigError(f"{pname} must be None or an int >= 1, got {val!r}")
    per_tensor_settings(per_tensor)


def per_tensor_settings(value: Any) -> dict | None:
    """``per_tensor``: None or false (off), true (the defaults) or a dict of PER_TENSOR_DEFAULTS' keys; checked
    without torch, so that a study config is validated before any job."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ScalingConfigError(f"per_tensor must be true, false or a mapping, got {value!r}")
    unknown = sorted(set(value) - set(PER_TENSOR_DEFAULTS))
    if unknown:
        raise ScalingConfigError(f"per_tensor: unknown setting(s) {', '.join(unknown)}; "
                                 f"settings: {', '.join(PER_TENSOR_DEFAULTS)}")
    out = {**PER_TENSOR_DEFAULTS, **value}
    for key, least in (("history", 1), ("margin", 0)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ScalingConfigError(f"per_tensor.{key} must be an int >= {least}, got {v!r}")
    b = out["boundaries"]
    if b is not None and not (isinstance(b, list) and b and all(isinstance(n, str) and n for n in b)):
        raise ScalingConfigError(f"per_tensor.boundaries must be a non-empty list of module names, got {b!r}")
    from lab.scaling.predictors import create_predictor
    try:
        create_predictor(out["predictor"], history="fp16")
    except ValueError as e:
        raise ScalingConfigError(f"per_tensor.predictor: {e}") from None
    return out

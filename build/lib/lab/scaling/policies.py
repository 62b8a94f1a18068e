"""The loss-scaling policies shipped with the lab.

Each one is a :class:`~lab.scaling.base.ScalingPolicy`: it only maps one step's outcome to the next
scale. Scale arithmetic is FP32: the engine stores the scale as a float32 tensor, and the products
are rounded to float32 exactly as the reference implementation does it (``kernel_mul`` reproduces
PyTorch's ``_amp_update_scale_`` kernel, ``fp32_mul`` Megatron-LM's float32 tensor product).
"""

from __future__ import annotations

import math
from typing import Any

from .base import ScalingConfigError, ScalingPolicy, fp32_mul, kernel_mul, register, to_f32

__all__ = ["NoScaling", "StaticScaling", "DynamicScaling", "HysteresisScaling",
           "GradNormScaling", "WarmupScaling"]


@register("none")
class NoScaling(ScalingPolicy):
    """Plain FP16 as people run it: scale 1, overflows are counted, steps are applied anyway.

    ``skip_on_overflow=True`` skips the optimiser step when the gradients hold inf/nan.
    """

    init_scale = 1.0
    skip_on_overflow = False

    def __init__(self, skip_on_overflow: bool = False):
        if not isinstance(skip_on_overflow, bool):
            raise self._err(f"skip_on_overflow must be a bool, got {skip_on_overflow!r}")
        self.skip_on_overflow = skip_on_overflow

    def update(self, scale, found_inf, step, grad_norm=None):
        return scale


@register("static")
class StaticScaling(ScalingPolicy):
    """Fixed loss scale ``scale``; a step with inf/nan gradients is skipped; the scale never changes."""

    def __init__(self, scale: float = 128.0):
        self.init_scale = self.check_positive("scale", scale)

    def update(self, scale, found_inf, step, grad_norm=None):
        return scale


@register("dynamic")
class DynamicScaling(ScalingPolicy):
    """Exactly ``torch.amp.GradScaler``'s rule, defaults and validation.

    inf/nan: ``scale *= backoff_factor``, tracker = 0.  Clean step: tracker += 1; when it reaches
    ``growth_interval`` the scale is multiplied by ``growth_factor`` unless the FP32 result is inf,
    and tracker = 0.  No lower bound.  Products round like PyTorch's kernel (double product, one
    rounding to float32).  state_dict keys match GradScaler's.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        growth_factor = self.check_number("growth_factor", growth_factor)
        backoff_factor = self.check_number("backoff_factor", backoff_factor)
        # Same messages (and, via ScalingConfigError, same AssertionError type) as GradScaler.
        if growth_factor <= 1.0:
            raise ScalingConfigError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise ScalingConfigError("The backoff factor must be < 1.0.")
        # Checks GradScaler lacks, for values that can only break training.
        if backoff_factor <= 0.0:
            raise self._err(f"backoff_factor must be > 0, got {backoff_factor!r}")
        self.init_scale = self.check_positive("init_scale", init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = self.check_int("growth_interval", growth_interval, 1)
        self._growth_tracker = 0

    def update(self, scale, found_inf, step, grad_norm=None):
        if found_inf:
            self._growth_tracker = 0
            return kernel_mul(scale, self.backoff_factor)
        successful = self._growth_tracker + 1
        if successful == self.growth_interval:
            self._growth_tracker = 0
            new = kernel_mul(scale, self.growth_factor)
            return new if math.isfinite(new) else scale  # never grow past FP32 range
        self._growth_tracker = successful
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Like GradScaler.load_state_dict, the saved factors/interval replace the configured ones.
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


@register("hysteresis")
class HysteresisScaling(ScalingPolicy):
    """Exactly Megatron-LM's ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py).

    inf/nan: growth_tracker = 0, hysteresis_tracker -= 1, and only when it is <= 0:
    ``scale = max(scale * backoff_factor, min_scale)``.  Clean step: growth_tracker += 1; at
    ``growth_interval``: growth_tracker = 0, hysteresis_tracker = hysteresis (refilled only here),
    ``scale *= growth_factor``.  Megatron keeps scale and factors as float32 tensors, so the
    products are FP32 products of float32-rounded factors; like Megatron there is no upper bound.
    Defaults are Megatron's command-line defaults (initial 2**32, window 1000, hysteresis 2,
    min 1.0, factors 2.0 / 0.5).  Every overflow step is skipped, as in Megatron.
    """

    def __init__(self, init_scale: float = 2.0**32, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        init_scale = self.check_positive("init_scale", init_scale)
        min_scale = self.check_positive("min_scale", min_scale)
        if min_scale > init_scale:
            raise self._err(f"min_scale ({min_scale!r}) must be <= init_scale ({init_scale!r})")
        growth_factor, backoff_factor = self.check_factors(growth_factor, backoff_factor)
        self.init_scale = init_scale
        self.min_scale = to_f32(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = self.check_int("growth_interval", growth_interval, 1)
        self.hysteresis = self.check_int("hysteresis", hysteresis, 1)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, scale, found_inf, step, grad_norm=None):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                new = fp32_mul(scale, self.backoff_factor)
                # torch.max(new, min_scale): NaN propagates
                return new if (new >= self.min_scale or math.isnan(new)) else self.min_scale
            return scale
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            return fp32_mul(scale, self.growth_factor)
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {"growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


@register("gradnorm")
class GradNormScaling(ScalingPolicy):
    """The source study's adaptive rule on the unscaled global gradient norm.

    An inf/nan step is skipped and the scale multiplied by ``backoff_factor`` (halved), at any time.
    For a finite step with index >= ``warmup_steps`` (0-based ``update()`` index, i.e. after
    ``warmup_steps`` updates): norm > ``high`` -> multiply by ``backoff_factor``; norm < ``low`` and
    scale < ``max_scale`` -> multiply by ``growth_factor``, capped at ``max_scale``.
    """

    needs_grad_norm = True

    def __init__(self, init_scale: float = 2.0**16, warmup_steps: int = 10, high: float = 1e3,
                 low: float = 1e-3, max_scale: float = 1e5, growth_factor: float = 1.2,
                 backoff_factor: float = 0.5):
        self.init_scale = self.check_positive("init_scale", init_scale)
        self.warmup_steps = self.check_int("warmup_steps", warmup_steps, 0)
        self.high = self.check_positive("high", high)
        self.low = self.check_number("low", low)
        if not 0.0 <= self.low < self.high:
            raise self._err(f"need 0 <= low < high, got low={low!r}, high={high!r}")
        self.max_scale = to_f32(self.check_positive("max_scale", max_scale))
        if to_f32(self.init_scale) > self.max_scale:
            raise self._err(f"init_scale ({init_scale!r}) must be <= max_scale ({max_scale!r})")
        self.growth_factor, self.backoff_factor = self.check_factors(growth_factor, backoff_factor)

    def update(self, scale, found_inf, step, grad_norm=None):
        if found_inf:
            return kernel_mul(scale, self.backoff_factor)
        if step < self.warmup_steps or grad_norm is None:
            return scale
        if grad_norm > self.high:
            return kernel_mul(scale, self.backoff_factor)
        if grad_norm < self.low and scale < self.max_scale:
            return min(kernel_mul(scale, self.growth_factor), self.max_scale)
        return scale


@register("warmup")
class WarmupScaling(ScalingPolicy):
    """Conservative start for fragile models.

    Starts at ``init_scale``; an overflow multiplies the scale by ``backoff_factor`` at any time and
    resets the clean-step tracker.  No growth during the first ``warmup_steps`` updates (their clean
    steps are not counted); afterwards the scale grows by ``growth_factor`` every ``growth_interval``
    consecutive clean steps, capped at ``max_scale`` (and never to FP32 inf).
    """

    def __init__(self, init_scale: float = 4096.0, warmup_steps: int = 50, growth_interval: int = 100,
                 max_scale: float = 65536.0, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.init_scale = self.check_positive("init_scale", init_scale)
        self.warmup_steps = self.check_int("warmup_steps", warmup_steps, 0)
        self.growth_interval = self.check_int("growth_interval", growth_interval, 1)
        self.max_scale = to_f32(self.check_positive("max_scale", max_scale))
        if to_f32(self.init_scale) > self.max_scale:
            raise self._err(f"init_scale ({init_scale!r}) must be <= max_scale ({max_scale!r})")
        self.growth_factor, self.backoff_factor = self.check_factors(growth_factor, backoff_factor)
        self._growth_tracker = 0

    def update(self, scale, found_inf, step, grad_norm=None):
        if found_inf:
            self._growth_tracker = 0
            return kernel_mul(scale, self.backoff_factor)
        if step < self.warmup_steps:
            return scale
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._growth_tracker = 0
            if scale < self.max_scale:
                new = min(kernel_mul(scale, self.growth_factor), self.max_scale)
                if math.isfinite(new):
                    return new
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {"growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._growth_tracker = int(state["growth_tracker"])

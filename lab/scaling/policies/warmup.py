"""``warmup``: a conservative start for fragile models (no growth for ``warmup_steps``, then growth up to a cap).

Also the base of ``smooth-capped`` (smooth_capped.py)."""

from __future__ import annotations

import math
from typing import Any

from ..base import ScalingPolicy, kernel_mul, register, to_f32

__all__ = ["WarmupScaling"]


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

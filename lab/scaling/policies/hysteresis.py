"""``hysteresis``: exactly Megatron-LM's ``DynamicGradScaler``."""

from __future__ import annotations

import math
from typing import Any

from ..base import ScalingPolicy, fp32_mul, register, to_f32

__all__ = ["HysteresisScaling"]


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

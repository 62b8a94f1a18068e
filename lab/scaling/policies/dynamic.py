"""``dynamic``: exactly ``torch.amp.GradScaler``'s rule, defaults and validation."""

from __future__ import annotations

import math
from typing import Any

from ..base import ScalingConfigError, ScalingPolicy, kernel_mul, register

__all__ = ["DynamicScaling"]


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

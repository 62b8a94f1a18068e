"""``none``: plain FP16 as people run it, scale 1 (overflows counted, steps applied unless ``skip_on_overflow``)."""

from __future__ import annotations

from ..base import ScalingPolicy, register

__all__ = ["NoScaling"]


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

"""``static``: a fixed loss scale; a step with inf/nan gradients is skipped."""

from __future__ import annotations

from ..base import ScalingPolicy, register

__all__ = ["StaticScaling"]


@register("static")
class StaticScaling(ScalingPolicy):
    """Fixed loss scale ``scale``; a step with inf/nan gradients is skipped; the scale never changes."""

    def __init__(self, scale: float = 128.0):
        self.init_scale = self.check_positive("scale", scale)

    def update(self, scale, found_inf, step, grad_norm=None):
        return scale

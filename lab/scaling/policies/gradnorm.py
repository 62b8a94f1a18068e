"""``gradnorm``: the source study's adaptive rule on the unscaled global gradient norm."""

from __future__ import annotations

from ..base import ScalingPolicy, kernel_mul, register, to_f32

__all__ = ["GradNormScaling"]


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

"""``amax-history``: a loss scale set from the gradients' recent maxima, found without overflowing.

Every dynamic policy finds its scale by overflowing: it grows until a step overflows, skips that step and backs
off. Transformer Engine scales FP8 tensors the other way ("delayed scaling", ``DelayedScaling`` in its recipe):
it keeps a history of each tensor's absolute maximum (amax) and sets the scale so that the history's largest
amax lands ``2**margin`` under the format's largest value. This policy applies that recipe to FP16 loss scaling:

* the engine observes, every step, the largest absolute value of the unscaled gradients (``grad_amax``: one
  reduction per gradient, fetched in the step's one host sync; ``needs_grad_amax``);
* the history holds the last ``history`` observations; the next scale is the largest power of two ``S`` with
  ``S * max(history) <= 65504 / 2**margin`` (65504 from ``torch.finfo``), clamped to [min_scale, max_scale];
* a step that overflowed is still skipped (the engine), and its observation is the least amax that explains
  the overflow, ``OVERFLOW_BOUND / (scale * 2**margin)``: the next scale is at most half the one that
  overflowed, and stays there while the observation is in the history (as a spike holds TE's scale down);
* a step whose gradients are all zero saw nothing at this scale: it counts as the largest amax that FP16 would
  flush, ``2**-25 / scale`` (an upper bound), so the scale rises to what the rest of the history allows.

What is observed is the parameters' gradients at ``unscale_``: the FP16 weight gradients of the backward, summed
over the step's micro-batches. The activation gradients inside the backward can sit above that observation (in the
study's FP32 runs up to 2 binades above the parameter gradients' maximum: docs/replay.md): ``margin`` covers them.
With gradient accumulation over k micro-batches the observation is a sum of k backwards, each ~1/k of it: the
policy is then safe but up to k times lower than it needs to be.
The defaults (``history`` 16, ``margin`` 3, ``init_scale`` 1024) were chosen by replaying the study's FP32 runs
(``benchmarks/calibration/amax_defaults.py``; docs/replay.md): margin 3 is the least with no replayed overflow in any family
and seed at any history from 4 up (margin 2 at history 16 overflowed twice on ResNet-50, whose activation
gradients sat 2 binades above its parameter gradients); history 16 holds a spike down for 16 steps, as in
Transformer Engine's FP8 primer; 1024 is a first scale that overflowed in no run of the study, where scale 1
flushes 29% of the LM's activation gradients in the first step. Start at 1 (``init_scale=1``) when even 1024 may
overflow: only gradients above 65504 overflow there.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Any

from ..base import ScalingPolicy, register, to_f32

__all__ = ["AmaxHistoryScaling", "amax_scale", "step_observation", "pow2_floor"]


@functools.cache
def _fp16():
    """lab.core.fp16 (FP16's bounds from torch.finfo), imported at the first step rather than with the policy: a
    study's validation builds the policy in a process that never imports torch."""
    from lab.core import fp16
    return fp16


def pow2_floor(x: float) -> float:
    """The largest power of two <= x (x > 0 and finite)."""
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    return math.ldexp(1.0, e - 1)


def amax_scale(amax: float, margin: int, min_scale: float, max_scale: float) -> float:
    """The largest power of two S with S * amax <= 65504 / 2**margin (FP16's max), clamped to [min_scale, max_scale]."""
    if amax <= 0.0:
        return max_scale
    target = _fp16().MAX / math.ldexp(amax, margin)
    if target >= max_scale:
        return max_scale
    return max(min_scale, pow2_floor(target)) if target > 0 else min_scale


def step_observation(scale: float, found_inf: bool, grad_amax: float | None, margin: int) -> float:
    """What one step says about the gradients' maximum at scale 1 (see the module docstring)."""
    if found_inf or grad_amax is None or not math.isfinite(grad_amax):
        return _fp16().OVERFLOW_BOUND / math.ldexp(scale, margin)
    if grad_amax == 0.0:
        return _fp16().UNDERFLOW_BOUND / scale
    return grad_amax


@register("amax-history")
class AmaxHistoryScaling(ScalingPolicy):
    """Loss scale from the history of the gradients' absolute maxima (module docstring): the largest power of
    two that keeps the last ``history`` steps' largest amax ``2**margin`` under FP16's 65504."""

    needs_grad_amax = True

    def __init__(self, history: int = 16, margin: int = 3, init_scale: float = 1024.0,
                 min_scale: float = 2.0**-24, max_scale: float = 2.0**24):
        self.history = self.check_int("history", history, 1)
        self.margin = self.check_int("margin", margin, 0)
        self.init_scale = self.check_positive("init_scale", init_scale)
        self.min_scale = to_f32(self.check_positive("min_scale", min_scale))
        self.max_scale = to_f32(self.check_positive("max_scale", max_scale))
        if not (0.0 < self.min_scale <= to_f32(self.init_scale) <= self.max_scale < math.inf):
            raise self._err(f"need 0 < min_scale <= init_scale <= max_scale < FP32 inf, got min_scale={min_scale!r}, "
                            f"init_scale={init_scale!r}, max_scale={max_scale!r}")
        self._amaxes: collections.deque[float] = collections.deque(maxlen=self.history)

    def update(self, scale, found_inf, step, grad_norm=None, grad_amax=None):
        if grad_amax is None and not found_inf:
            raise self._err("update() needs grad_amax (the engine passes it: build the scaler with "
                            "lab.scaling.create('amax-history'))")
        self._amaxes.append(step_observation(scale, found_inf, grad_amax, self.margin))
        return amax_scale(max(self._amaxes), self.margin, self.min_scale, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"amax_history": list(self._amaxes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._amaxes = collections.deque((float(a) for a in state["amax_history"]), maxlen=self.history)

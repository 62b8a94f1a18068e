"""DeepSpeed's two dynamic loss-scaling rules (transcribed from deepspeed 0.19.8), and how a lab run ends at the floor.

* ``deepspeed``: ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py:253-288), the scaler
  ZeRO stages 1-3 build (``CreateLossScaler``, loss_scaler.py:293-299; zero/stage_1_and_2.py:722,
  zero/stage3.py:524), with delayed shift (hysteresis), optional consecutive hysteresis and an error at the
  minimum scale.
* ``deepspeed-fp16``: ``_update_scale`` of the non-ZeRO FP16 optimisers (``FP16_Optimizer``,
  fp16/fused_optimizer.py:404-429, and ``FP16_UnfusedOptimizer``, fp16/unfused_optimizer.py:277-302, the same
  rule): no hysteresis, and the scale simply stays at the minimum.

Both take DeepSpeed's config defaults (runtime/precision_config.py:135-157, passed through
``dynamic_loss_scale_args``, :202): ``initial_scale_power`` 16 (init 2**16), ``loss_scale_window`` 1000,
``hysteresis`` 2, ``consecutive_hysteresis`` False, ``min_loss_scale`` 1. This module imports nothing from
DeepSpeed; tests/test_deepspeed_policy.py drives the real code side by side with these policies.
"""

from __future__ import annotations

import math
from typing import Any

from ..base import ScalingPolicy, register, to_f32

__all__ = ["ScaleFloorReached", "DeepSpeedScaling", "DeepSpeedFP16Scaling"]

#: DeepSpeed's message (loss_scaler.py:258-259)
DEEPSPEED_FLOOR_MESSAGE = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


class ScaleFloorReached(RuntimeError):
    """The ``deepspeed`` policy overflowed at its minimum scale with the hysteresis spent: DeepSpeed ends the run here.

    Raised from ``LossScaler.update()`` (i.e. from the policy's ``update``) exactly where DeepSpeed's
    ``DynamicLossScaler.update_scale`` raises its bare ``Exception`` (loss_scaler.py:257-259). Attributes:
    ``step`` (the 0-based ``update()`` index of the overflow), ``scale`` (the scale, == ``min_scale``) and
    ``min_scale``. The step's ``scaler.step(optimizer)`` already skipped the optimiser step (its gradients hold
    inf/nan) and the policy's state is that of the previous step; the engine counts the step (an overflow,
    skipped) and ends the iteration before the exception leaves ``update()``. A lab run then ends with status
    ``diverged`` and this message as its reason (lab/run/loop.py), its files written as for any other end.
    """

    def __init__(self, step: int, scale: float, min_scale: float):
        self.step, self.scale, self.min_scale = step, scale, min_scale
        super().__init__(f"{DEEPSPEED_FLOOR_MESSAGE} (loss scale {scale:g} == min_scale {min_scale:g}, overflow at "
                         f"update {step}, hysteresis spent)")


def _check_scales(policy: ScalingPolicy, init_scale: Any, min_scale: Any) -> tuple[float, float]:
    """init_scale and min_scale: positive, finite and nonzero in FP32, min_scale <= init_scale."""
    init_scale = policy.check_positive("init_scale", init_scale)
    min_scale = policy.check_positive("min_scale", min_scale)
    for pname, value in (("init_scale", init_scale), ("min_scale", min_scale)):
        f = to_f32(value)
        if not (0.0 < f < math.inf):
            raise policy._err(f"{pname} must be a positive value within FP32 range, got {value!r}")
    if to_f32(min_scale) > to_f32(init_scale):
        # DeepSpeed accepts it, and its max(scale / 2, min_scale) then *raises* the scale on an overflow.
        raise policy._err(f"min_scale ({min_scale!r}) must be <= init_scale ({init_scale!r})")
    return init_scale, min_scale


def _bool(policy: ScalingPolicy, pname: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise policy._err(f"{pname} must be a bool, got {value!r}")
    return value


def _grown(scale: float) -> float:
    """``scale * 2`` (DeepSpeed's ``cur_scale *= scale_factor``), unless that is inf in FP32 (then ``scale``)."""
    grown = to_f32(scale * 2.0)
    return grown if math.isfinite(grown) else scale


@register("deepspeed")
class DeepSpeedScaling(ScalingPolicy):
    """Exactly DeepSpeed's ``DynamicLossScaler`` as ZeRO stages 1-3 use it, with DeepSpeed's config defaults.

    The rule (loss_scaler.py:253-288), per ``update()``; ``cur_iter`` counts updates, ``last_overflow_iter``
    starts at -1, ``cur_hysteresis`` at ``hysteresis`` (DeepSpeed's ``delayed_shift``):

    * overflow: if ``hysteresis == 1`` or ``cur_hysteresis == 1``: at ``scale == min_scale`` (and
      ``raise_at_min_scale``) raise :class:`ScaleFloorReached` without changing anything, else
      ``scale = max(scale / 2, min_scale)`` (``cur_hysteresis`` stays 1: once spent, every overflow halves);
      otherwise ``cur_hysteresis -= 1`` and the scale is kept. Either way ``last_overflow_iter = cur_iter``.
    * clean step: with ``consecutive_hysteresis``, ``cur_hysteresis = hysteresis`` (refilled by every clean
      step). ``stable = cur_iter - last_overflow_iter - 1``; if ``stable > 0`` and ``stable % scale_window == 0``
      the scale doubles (and without ``consecutive_hysteresis`` ``cur_hysteresis`` is refilled, only here).
    * ``cur_iter += 1``.

    So the first doubling comes after ``scale_window + 1`` consecutive clean steps (one later than
    ``torch.amp.GradScaler``/``dynamic`` with ``growth_interval == scale_window``), later ones every
    ``scale_window`` steps. Every overflow step is skipped (ZeRO returns before the optimiser step,
    zero/stage_1_and_2.py:3046-3067), including those the hysteresis absorbs. The factor is DeepSpeed's
    hard-coded 2.0. Defaults: init 2**16, window 1000, hysteresis 2, consecutive_hysteresis False,
    min_scale 1, raise_at_min_scale True (``DynamicLossScaler``'s ``raise_error_at_min_scale`` default; the
    DeepSpeed config does not expose it).

    Rounding: DeepSpeed keeps ``cur_scale`` as a Python float (an int, 2**initial_scale_power, until it first
    changes) and multiplies the loss by it, which PyTorch does with the scalar cast to FP32. The lab keeps the
    scale in FP32 as for every policy: the engine rounds what ``update`` returns to FP32, ``min_scale`` is
    rounded to FP32 and the floor test compares FP32 values. Halving and doubling are exact in both formats,
    so within FP32's normal range the lab's scale is ``float32(cur_scale)`` at every step, and equal to it
    whenever ``init_scale`` and ``min_scale`` are FP32 values, which is every value DeepSpeed's config can
    give below 2**24 (``min_loss_scale`` is an integer there, the initial scale a power of two). One
    deviation: DeepSpeed doubles past FP32's range (a Python float reaches 2**128, which as an FP32 scalar is
    inf, so its next step overflows); the lab refuses that doubling and keeps the scale (the counters move as
    in DeepSpeed).

    At the floor: DeepSpeed raises ``Exception("Current loss scale already at minimum - cannot decrease
    scale anymore. Exiting run.")`` from the optimiser's ``step()``. This policy raises
    :class:`ScaleFloorReached` (a ``RuntimeError``) from ``scaler.update()`` at that same step. A lab
    training run catches it around ``scaler.update()`` and ends the run as a recorded outcome, not a crash:
    stop training, keep the model as it is (the overflowing step was already skipped), write the run's
    metrics and steps so far with the exception's ``step`` and ``scale`` (the step as its last, skipped
    step), mark the run as ended at the loss-scale floor (not as failed), and exit normally. With
    ``raise_at_min_scale=False`` (DeepSpeed's ``raise_error_at_min_scale=False``) the scale stays at the
    minimum and the run goes on.

    ``state_dict``: DeepSpeed's counters, ``cur_iter``, ``last_overflow_iter`` and ``cur_hysteresis`` (the
    engine saves the scale).
    """

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, raise_at_min_scale: bool = True):
        init_scale, min_scale = _check_scales(self, init_scale, min_scale)
        self.init_scale = init_scale
        self.min_scale = to_f32(min_scale)
        self.scale_window = self.check_int("scale_window", scale_window, 1)
        # DeepSpeed's config accepts hysteresis 0 (and below), with which its scale never decreases: refused.
        self.hysteresis = self.check_int("hysteresis", hysteresis, 1)
        self.consecutive_hysteresis = _bool(self, "consecutive_hysteresis", consecutive_hysteresis)
        self.raise_at_min_scale = _bool(self, "raise_at_min_scale", raise_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    def update(self, scale, found_inf, step, grad_norm=None):
        new = scale
        if found_inf:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if scale == self.min_scale and self.raise_at_min_scale:
                    raise ScaleFloorReached(step, scale, self.min_scale)
                new = max(scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                new = _grown(scale)
        self.cur_iter += 1
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


@register("deepspeed-fp16")
class DeepSpeedFP16Scaling(ScalingPolicy):
    """Exactly the scale rule of DeepSpeed's non-ZeRO FP16 optimisers (``FP16_Optimizer`` and
    ``FP16_UnfusedOptimizer``, ``_update_scale``: fp16/fused_optimizer.py:404-429, fp16/unfused_optimizer.py:277-302).

    * overflow: ``scale = max(scale / 2, min_scale)``, ``last_overflow_iter = cur_iter``; at the minimum the
      scale stays there and training goes on (no error, no hysteresis: DeepSpeed's ``hysteresis`` and
      ``consecutive_hysteresis`` settings are ignored by these optimisers).
    * clean step: ``stable = cur_iter - last_overflow_iter - 1``; if ``stable > 0`` and
      ``stable % scale_window == 0`` the scale doubles (first after ``scale_window + 1`` clean steps, then
      every ``scale_window``).
    * ``cur_iter += 1``.

    Defaults are what ``DeepSpeedEngine`` passes (engine.py ``_configure_fp16_optimizer``: the config's
    ``dynamic_loss_scale_args``): init 2**16, window 1000, min_scale 1. (The optimisers' own fallbacks, init
    2**32 or min 0.25 in loss_scaler.py:55-70, apply only when they are built without those arguments.)
    Every overflow step is skipped (``step()`` returns early, fused_optimizer.py:274-275 and 151-161). Rounding
    as in ``deepspeed`` (FP32 scale; a doubling to FP32 inf is refused). ``state_dict``: ``cur_iter``,
    ``last_overflow_iter``, as in the optimisers' own state_dict.
    """

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0):
        init_scale, min_scale = _check_scales(self, init_scale, min_scale)
        self.init_scale = init_scale
        self.min_scale = to_f32(min_scale)
        self.scale_window = self.check_int("scale_window", scale_window, 1)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, scale, found_inf, step, grad_norm=None):
        new = scale
        if found_inf:
            new = max(scale / 2.0, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                new = _grown(scale)
        self.cur_iter += 1
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])

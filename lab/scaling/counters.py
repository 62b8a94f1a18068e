"""What the loss scaler counts, and its two guards: the alert and the FP32 fallback.

:class:`StepCounters` is LossScaler's base class (lab/scaling/engine.py): the engine decides per iteration
whether inf/nan was found; this part keeps the record of it (overflow and skipped steps, runs of skips),
raises the alert after ``alert_after`` consecutive skips and switches to FP32 after ``fp32_fallback_after``,
and saves and restores those counters with the scaler's state_dict.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("lab.scaling")

_INT_COUNTERS = ("steps", "overflow_steps", "skipped_steps", "consecutive_skips", "max_consecutive_skips", "alerts",
                 "initial_overflow_steps", "growth_steps")
_OPTIONAL_INDICES = ("fallback_step", "first_clean_step")  # an update() index, or None before it happens
_FLAGS = ("fp32_fallback", "last_found_inf", "last_step_skipped")  # fp32_fallback: a property over _fp32_fallback
#: counters saved in state_dict next to the scale and the policy's own state
COUNTER_KEYS = (*_INT_COUNTERS, *_OPTIONAL_INDICES, *_FLAGS)


class StepCounters:
    """The counters and guards of a scaler. The subclass provides ``policy``, ``alert_after``,
    ``fp32_fallback_after``, ``_scale_value`` and ``_set_scale`` (the fallback sets the scale to 1.0)."""

    def _reset_counters(self) -> None:
        self._load_counters({})  # every counter 0, no fallback, flags False
        self.last_grad_norm: float | None = None
        self.last_grad_amax: float | None = None  # set by update() when the policy observes the maximum

    def restart_counters(self) -> None:
        """Count from update() 0 again, the scale and the policy's state kept: after empty-gradient steps before
        training (train.settle_steps), whose overflows are not training's. An FP32 fallback that fired stays."""
        fallback, at = self._fp32_fallback, self.fallback_step
        self._reset_counters()
        self._fp32_fallback, self.fallback_step = fallback, at

    @property
    def fp32_fallback(self) -> bool:
        """True once the FP32 fallback guard fired (the loop should then turn autocast off)."""
        return self._fp32_fallback

    @property
    def update_ratio(self) -> float:
        """Share of update() calls whose step was applied (1.0 before the first update)."""
        return 1.0 if self.steps == 0 else (self.steps - self.skipped_steps) / self.steps

    @property
    def in_training_overflow_steps(self) -> int:
        """Overflow steps after the first clean step: what the policy's probing costs once it found its range
        (the ``initial_overflow_steps`` before it are the descent from the initial scale)."""
        return self.overflow_steps - self.initial_overflow_steps

    def _record(self, index: int, found_inf: bool, grad_norm: float | None, grew: bool = False) -> None:
        """Count update() number ``index`` (``grew``: it raised the scale); run the guards on a skipped step."""
        skipped = found_inf and (self.policy.skip_on_overflow or self._fp32_fallback)
        self.last_found_inf = found_inf
        self.last_step_skipped = skipped
        self.last_grad_norm = grad_norm
        self.growth_steps += int(grew)
        if self.first_clean_step is None and not found_inf:
            self.first_clean_step = index
        if found_inf:
            self.overflow_steps += 1
            self.initial_overflow_steps += int(self.first_clean_step is None)
        if not skipped:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        n = self.consecutive_skips = self.consecutive_skips + 1
        if n > self.max_consecutive_skips:
            self.max_consecutive_skips = n
        if self.alert_after is not None and n == self.alert_after:
            self.alerts += 1
            logger.warning("loss scaling (%s): %d consecutive skipped steps at update %d, scale %g",
                           self.policy.name, n, index, self._scale_value)
        if (self.fp32_fallback_after is not None and not self._fp32_fallback
                and n >= self.fp32_fallback_after):
            self._fp32_fallback = True
            self.fallback_step = index
            self._set_scale(1.0)
            logger.warning("loss scaling (%s): %d consecutive skipped steps at update %d: falling back to "
                           "FP32 (scale 1.0, policy frozen)", self.policy.name, n, index)

    def _counters_state(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in COUNTER_KEYS}
        if self.scale_resets:
            out["scale_resets"] = [dict(r) for r in self.scale_resets]
        return out

    def _load_counters(self, state_dict: dict[str, Any]) -> None:
        """Missing counters (a GradScaler state_dict) start from zero."""
        for name in _INT_COUNTERS:
            setattr(self, name, int(state_dict.get(name, 0)))
        for name in _OPTIONAL_INDICES:
            value = state_dict.get(name)
            setattr(self, name, None if value is None else int(value))
        self._fp32_fallback, self.last_found_inf, self.last_step_skipped = (
            bool(state_dict.get(name, False)) for name in _FLAGS)
        self.scale_resets = [dict(r) for r in state_dict.get("scale_resets", [])]

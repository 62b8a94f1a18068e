"""The overflow rules of the diagnosis: non-finite losses (the forward pass, or weights that blew up), overflowing
and skipped steps, overflowing steps applied anyway, and the layers whose gradients turned non-finite first."""
from __future__ import annotations

import math

from lab.diagnose import branch
from lab.diagnose.record import HEALTHY_UPDATE_RATIO, Diagnosis, _Builder, _halvings, _pct, _Step, _steps_span

RISE_FACTOR = 2.0   # the last finite loss this many times the lowest before it: the run was diverging


def nonfinite_loss_findings(b: _Builder, d: Diagnosis, steps: list[_Step], nonfinite: list[int],
                            fp16_rows: list[_Step], fp32_rows: list[_Step], lr) -> None:
    """Non-finite loss: the forward pass, which no loss scale reaches, or weights that blew up (the loss rose first,
    or the run computes in FP32/bf16, whose range is FP32's)."""
    if not nonfinite:
        return
    fp16, fb = d.precision == "fp16", d.fallback_step
    fwd16 = [i for i in nonfinite if fp16 and (fb is None or steps[i].step <= fb)]
    after_fb = [i for i in nonfinite if fb is not None and steps[i].step > fb]
    tail = len(steps) - nonfinite[-1] == 1 and all(not math.isfinite(s.loss) for s in steps[nonfinite[0]:])
    msg = (f"the training loss was NaN/inf on {len(nonfinite)} of {d.steps} steps, first at step "
           f"{d.first_nonfinite_loss_step}"
           + (" and on every step after it" if tail and len(nonfinite) > 1 else ""))
    applied_before = sum(1 for s in steps[:nonfinite[0]] if not s.skipped)
    rise = _rise_before(steps, nonfinite[0])
    if rise:
        msg += (f"; the loss rose from {rise[0]:.3g} to {rise[1]:.3g} over the applied steps before it: the training "
                "diverged")
    elif fwd16:
        chased = _halvings([s.scale for s in fp16_rows if s.step >= steps[nonfinite[0]].step])
        msg += ("; a non-finite loss comes from the forward pass, so no loss scale can prevent it"
                + (f" (the scaler halved the scale {chased} times chasing it)"
                   if d.policy not in ("none", "static") else ""))
    b.find("loss_nonfinite", "problem", msg, steps=len(nonfinite), first_step=d.first_nonfinite_loss_step,
           to_the_end=tail, applied_updates_before=applied_before, after_fallback=len(after_fb), diverging=bool(rise))
    lr_txt = f" (now {lr:g})" if isinstance(lr, (int, float)) else ""
    if after_fb:
        b.recommend("lower_lr", f"Lower the learning rate{lr_txt}",
                    f"after the FP32 fallback at step {fb} the loss was still non-finite on "
                    f"{len(after_fb)} of {len(fp32_rows)} FP32 steps: precision is not the cause, the "
                    "weights themselves blew up", "loss_nonfinite")
    elif not fp16:
        b.recommend("lower_lr", f"Lower the learning rate{lr_txt}",
                    f"this run computes in {d.precision}, whose range is FP32's: a non-finite loss here is the "
                    "optimisation's (learning rate, data), not FP16's", "loss_nonfinite")
    elif rise:
        b.recommend("lower_lr", f"Lower the learning rate{lr_txt}",
                    f"the loss rose from {rise[0]:.3g} to {rise[1]:.3g} before it became non-finite, after "
                    f"{applied_before} applied updates: a divergence FP32 would show as well, not an FP16 overflow",
                    "loss_nonfinite")
    elif isinstance(lr, (int, float)) and lr >= 1.0:
        b.recommend("lower_lr", f"Lower the learning rate{lr_txt}",
                    f"the loss was finite for {nonfinite[0]} step(s) and became non-finite after "
                    f"{applied_before} applied update(s); with lr {lr:g} one update moves weights past "
                    "FP16's largest value (65504)", "loss_nonfinite")
    if fwd16 and not after_fb and not rise and not d.forward_overflow:  # located: forward.py names the module
        b.recommend("bf16", "Keep the module whose output left FP16's range in FP32, or train in bf16 (FP32's range)",
                    f"the FP16 forward pass produced a non-finite loss on {len(fwd16)} steps; no loss scale reaches "
                    "the forward pass", "loss_nonfinite", change={"precision": "bf16"})


def _rise_before(steps: list[_Step], first_bad: int) -> tuple[float, float] | None:
    """(lowest, last) finite applied loss before row ``first_bad`` when the last is RISE_FACTOR times the lowest."""
    before = [s.loss for s in steps[:first_bad] if math.isfinite(s.loss) and not s.skipped]
    if len(before) < 3:
        return None
    low, last = min(before[:-1]), before[-1]
    return (low, last) if low > 0 and last >= RISE_FACTOR * low else None


def overflow_findings(b: _Builder, d: Diagnosis, steps: list[_Step], fp16_rows: list[_Step],
                      longest_skip: tuple[int, int] | None) -> None:
    """Overflowing and skipped steps (or too few updates), and overflowing steps applied anyway."""
    if d.overflow_steps:
        skip_part = (f"{d.skipped_steps} skipped (skip rate {_pct(d.skip_rate)}), longest skip streak "
                     f"{d.longest_skip_streak} ({_steps_span(steps, *longest_skip)})"
                     if d.skipped_steps else "none skipped")
        sev = ("problem" if d.skip_rate >= 0.5 else "warning" if d.update_ratio <= HEALTHY_UPDATE_RATIO else "info")
        split = (f"{d.initial_overflow_streak} in the initial descent, {d.overflow_in_training} in training"
                 + (f" ({d.overflow_per_1k:.2f} per 1000 steps, {d.growth_attempts} growth attempts)"
                    if d.overflow_per_1k is not None else ""))
        b.find("overflow", sev, f"{d.overflow_steps} of {d.steps} steps had inf/nan gradients (first at step "
               f"{d.first_overflow_step}; {split}); {skip_part}; {_pct(d.update_ratio)} of steps updated the weights",
               overflow_initial=d.initial_overflow_streak, overflow_in_training=d.overflow_in_training,
               overflow_per_1k=d.overflow_per_1k, growth_attempts=d.growth_attempts,
               overflow_steps=d.overflow_steps, skipped_steps=d.skipped_steps, skip_rate=d.skip_rate,
               update_ratio=d.update_ratio, longest_skip_streak=d.longest_skip_streak)
    elif d.steps and d.update_ratio <= HEALTHY_UPDATE_RATIO:
        b.find("low_update_ratio", "warning", f"only {_pct(d.update_ratio)} of steps updated the weights "
               f"(healthy: > {_pct(HEALTHY_UPDATE_RATIO)})", update_ratio=d.update_ratio)

    applied_ovf = [s for s in fp16_rows if s.found_inf and not s.skipped]
    if applied_ovf:
        b.find("overflow_applied", "problem" if d.nonfinite_loss_steps else "warning",
               f"{len(applied_ovf)} steps with inf/nan gradients were applied anyway (policy {d.policy} does not "
               "skip): non-finite values reached the optimizer", steps=len(applied_ovf))
        b.recommend("skip_on_overflow", "Use a policy that skips overflowing steps (static, dynamic or "
                    "hysteresis; for 'none': skip_on_overflow: true)",
                    f"{len(applied_ovf)} updates were computed from inf/nan gradients", "overflow_applied")


def overflow_layer_findings(b: _Builder, d: Diagnosis, steps: list[_Step], has_layer_column: bool) -> None:
    """Which layers' gradients became non-finite first, overall and after the initial overflow streak."""
    if d.overflow_layers:
        top = list(d.overflow_layers.items())[:3]
        with_layer = sum(d.overflow_layers.values())
        later = list(d.later_overflow_layers.items())[:3]
        after = ""
        if later and d.initial_overflow_streak:
            n_later = sum(d.later_overflow_layers.values())
            after = (f"; after the first clean step (step {steps[d.initial_overflow_streak].step}): " + ", ".join(
                f"{name}{branch.label(d, name)} on {c} of {n_later}" for name, c in later))
        b.find("overflow_layers", "info", "first non-finite gradient (backward order): " + ", ".join(
               f"{name}{branch.label(d, name)} on {c} of {with_layer} overflow steps" for name, c in top) + after,
               layers=dict(top), later_layers=dict(later))
    elif d.overflow_steps and d.precision == "fp16" and not has_layer_column:
        d.notes.append("steps.csv has no first_nonfinite_layer column: which layer overflowed was not recorded")

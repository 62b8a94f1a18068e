"""The loss-scale rules of the diagnosis: what the FP16 steps' scale trajectory says (lab/diagnose/ runs them).

An initial overflow streak (the initial or static scale is too high), a collapse, a runaway, overflow at scale
<= 1, overflows right after each growth step, and isolated one-step spikes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lab.diagnose.record import (HEALTHY_UPDATE_RATIO, Diagnosis, _Builder, _halvings, _Step, _steps_span, _streaks,
                                 fmt_scale, fmt_scale_value)

ALERT_STREAK = 3                 # consecutive overflows that count as a streak (the engine's alert_after)
LONG_STREAK = 10                 # an initial streak this long (or >= 5 % of the run) is worth a warning
COLLAPSE_FACTOR = 2.0 ** 10      # the scale fell this far below the first scale that worked
RUNAWAY_SCALE = 2.0 ** 24        # the scale grew above this (or to inf)


@dataclass
class _Trajectory:
    """The FP16 steps as the scale rules read them."""
    rows: list[_Step]
    seq: list[float]                  # the scale each step used, then the one after the last update (no fallback)
    streaks: list[tuple[int, int]]    # overflow streaks: (start index, length)
    initial: int                      # the leading overflow streak's length (0: the first step was clean)
    working: float | None             # the scale of the first clean step after it: the first scale that worked


def scale_findings(b: _Builder, d: Diagnosis, rows: list[_Step], scaler_cfg: dict) -> None:
    """Initial overflow streak, collapse, runaway, isolated spikes, overflow right after growth."""
    streaks = _streaks([s.found_inf for s in rows])
    initial = streaks[0][1] if streaks and streaks[0][0] == 0 else 0
    after_last = [d.final_scale] if d.fallback_step is None and d.final_scale is not None else []
    t = _Trajectory(rows=rows, seq=[s.scale for s in rows] + after_last, streaks=streaks, initial=initial,
                    working=rows[initial].scale if initial < len(rows) else None)
    _initial_streak_findings(b, t)
    _collapse_findings(b, d, t, scaler_cfg)
    _runaway_findings(b, t)
    _low_scale_overflow_findings(b, t, scaler_cfg)
    _overflow_pattern_findings(b, d, t, scaler_cfg)


def _initial_streak_findings(b: _Builder, t: _Trajectory) -> None:
    """A leading overflow streak with a finite loss: the initial (or the static) scale is too high."""
    rows, seq, initial, working = t.rows, t.seq, t.initial, t.working
    n, init, dynamic = len(rows), seq[0], len(set(seq)) > 1
    if initial < ALERT_STREAK or not all(math.isfinite(s.loss) for s in rows[:initial]):
        return
    sev = ("problem" if initial >= 0.5 * n else "warning" if initial >= LONG_STREAK or initial >= 0.05 * n
           else "info")
    if working is not None and dynamic:
        msg = (f"the first {initial} steps overflowed while the scale fell from {fmt_scale(init)} to "
               f"{fmt_scale(working)}: init_scale {fmt_scale(init)} is too high for this model")
        action = f"Lower init_scale to {fmt_scale_value(working)}"
        why = (f"step {rows[initial].step} was the first clean step, at scale {fmt_scale(working)}; the {initial} "
               f"steps before it were skipped")
    elif working is None and dynamic and min(s.scale for s in rows) <= 1:
        # overflow at every scale down to <= 1: the values exceed FP16's range unscaled (overflow_at_low_scale
        # advises); lowering the scale further is advice the run has already tried
        low = min(s.scale for s in rows)
        b.find("overflow_every_scale", "problem",
               f"every one of the {n} steps overflowed, at every scale from {fmt_scale(init)} down to "
               f"{fmt_scale(low)}: the gradients are beyond FP16's range whatever the scale; the model, not the "
               "loss scale, is the problem (the loss stayed finite)", streak=initial, init_scale=init,
               lowest_scale=low)
        return
    elif working is None and dynamic:
        low = min(s.scale for s in rows)
        msg = (f"every one of the {n} steps overflowed while the scale halved from {fmt_scale(init)} to "
               f"{fmt_scale(seq[-1])}; the scaler never reached a scale that works")
        action = f"Lower init_scale below {fmt_scale_value(low)} (the lowest scale tried, which overflowed)"
        why = (f"{initial} consecutive overflows from init_scale {fmt_scale(init)} down to {fmt_scale(low)}, with a "
               "finite loss: the run ended before the scale came down to where its gradients fit")
    else:
        msg = (f"the first {initial} steps" if working is not None else f"all {n} steps") + \
              f" overflowed at the constant scale {fmt_scale(init)}"
        action = (f"Lower the loss scale below {fmt_scale(init)}, or use dynamic scaling (it finds the scale from "
                  "the overflows)" if init > 1 else "Train in bf16")
        why = f"{initial} consecutive steps overflowed at scale {fmt_scale(init)} with a finite loss"
    if sev == "info":
        msg += f"; harmless here ({initial} of {n} steps skipped)"
    b.find("init_scale_too_high", sev, msg, streak=initial, init_scale=init, first_working_scale=working)
    if sev != "info":
        target = working if working is not None else min(s.scale for s in rows) / 2
        change = {"init_scale": target} if dynamic else ({"scale_below": init} if init > 1 else {"precision": "bf16"})
        b.recommend("lower_init_scale" if dynamic else "lower_scale", action, why, "init_scale_too_high",
                    change=change)


def _collapse_findings(b: _Builder, d: Diagnosis, t: _Trajectory, scaler_cfg: dict) -> None:
    """The scale collapsed: to <= 1, far below the first scale that worked, or halving to the end after it worked."""
    rows, seq, streaks, working = t.rows, t.seq, t.streaks, t.working
    init, low = seq[0], min(seq)
    after = seq[t.initial:] if working is not None else []
    ending = (streaks[-1] if streaks and streaks[-1][0] + streaks[-1][1] == len(rows) and streaks[-1][0] > 0
              else None)
    collapse = []
    if init > 1 and low <= 1:
        collapse.append(f"to {fmt_scale(low)} (<= 1: it no longer amplifies anything)")
    if working and after and working / min(after) >= COLLAPSE_FACTOR:
        collapse.append(f"2^{int(round(math.log2(working / min(after))))} below {fmt_scale(working)}, "
                        "the first scale that worked")
    if ending and ending[1] >= 5 and _halvings(seq[ending[0]:]) >= 4:
        collapse.append(f"halving on each of the last {ending[1]} steps ({_steps_span(rows, *ending)}) "
                        + ("before the FP32 fallback" if d.fallback_step is not None else "without recovering"))
    if not collapse:
        return
    b.find("scale_collapse", "problem",
           f"the loss scale collapsed from {fmt_scale(init)} to {fmt_scale(low)} ({d.scale_halvings} halvings): "
           + "; ".join(collapse), init_scale=init, min_scale=low, halvings=d.scale_halvings)
    low_ovf = [s for s in rows if s.found_inf and math.isfinite(s.loss)]
    if not d.nonfinite_loss_steps and low_ovf:
        b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                    f"gradients kept overflowing while the scale fell to {fmt_scale(low)}: the values exceed "
                    "FP16's range however small the scale", "scale_collapse", change={"precision": "bf16"})
    if scaler_cfg.get("fp32_fallback_after") is None and not d.nonfinite_loss_steps:
        b.recommend("fp32_fallback", "Enable fp32_fallback_after: 10 (the fp16-dynamic-fallback mode)",
                    f"the scaler kept halving ({d.scale_halvings} times, down to {fmt_scale(low)}) and skipping "
                    f"({d.longest_skip_streak} steps in a row) instead of continuing in FP32", "scale_collapse",
                    change={"fp32_fallback_after": 10})


def _runaway_findings(b: _Builder, t: _Trajectory) -> None:
    """The scale grew to > 2^24 or inf."""
    init = t.seq[0]
    grown = [x for x in t.seq if x > init and (x > RUNAWAY_SCALE or math.isinf(x))]
    if not grown:
        return
    top = max(grown)
    b.find("scale_runaway", "warning" if math.isfinite(top) else "problem",
           f"the loss scale ran away from {fmt_scale(init)} to {fmt_scale(top)} (> 2^24 or inf): with no "
           "overflow to stop it, gradients are so small (or zero) that the scale only grows", max_scale=top)
    b.recommend("cap_scale", "Cap the scale (max_scale, e.g. 65536: the warmup or bounded policies)",
                f"the scale reached {fmt_scale(top)}; a later real gradient would overflow at once and "
                "skip a long streak to come back", "scale_runaway")


def _low_scale_overflow_findings(b: _Builder, t: _Trajectory, scaler_cfg: dict) -> None:
    """Overflow at scale <= 1: the values themselves exceed FP16's range."""
    low_scale_ovf = [s for s in t.rows if s.found_inf and s.scale <= 1 and math.isfinite(s.loss)]
    if not low_scale_ovf:
        return
    sev = "problem" if len(low_scale_ovf) >= max(2, 0.05 * len(t.rows)) else "warning"
    b.find("overflow_at_low_scale", sev,
           f"{len(low_scale_ovf)} steps overflowed at scale <= 1 with a finite loss (first at step "
           f"{low_scale_ovf[0].step}): gradients exceed FP16's 65504 without any scaling",
           steps=len(low_scale_ovf))
    b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                f"{len(low_scale_ovf)} steps overflowed even at scale <= 1, so no loss scale fits",
                "overflow_at_low_scale", change={"precision": "bf16"})
    if scaler_cfg.get("fp32_fallback_after") is None:
        b.recommend("fp32_fallback", "Or enable fp32_fallback_after: 10 to continue in FP32",
                    f"{len(low_scale_ovf)} overflows at scale <= 1", "overflow_at_low_scale",
                    change={"fp32_fallback_after": 10})


def _overflow_pattern_findings(b: _Builder, d: Diagnosis, t: _Trajectory, scaler_cfg: dict) -> None:
    """Overflows after the start: mostly right after the scale grew (oscillation), else isolated spikes."""
    rows, seq, initial = t.rows, t.seq, t.initial
    # isolated one-step overflows after the start, each halving the scale
    spikes = [(i, seq[i], seq[i + 1]) for i, length in t.streaks if length == 1 and i >= max(initial, 1)
              and i + 1 < len(seq) and seq[i + 1] < seq[i] and math.isfinite(rows[i].loss)]
    after_growth = [i for i in range(1, len(rows)) if rows[i].found_inf and rows[i].scale > rows[i - 1].scale]
    later = sum(s.found_inf for s in rows[initial:])
    if len(after_growth) >= ALERT_STREAK and len(after_growth) * 2 >= later:
        _growth_oscillation_findings(b, d, seq[initial:], len(after_growth), later, scaler_cfg)
    elif len(spikes) >= 2:
        _isolated_spike_findings(b, d, rows, spikes, scaler_cfg)


def _growth_oscillation_findings(b: _Builder, d: Diagnosis, later_seq: list[float], overflows_after_growth: int,
                                 later: int, scaler_cfg: dict) -> None:
    """Most of the later overflows came right after a growth step: the scale oscillates."""
    gi = scaler_cfg.get("growth_interval")
    if d.policy == "amax-history":  # its scale follows the observed maxima: the margin is what was too thin
        m = scaler_cfg.get("margin", 3)
        b.find("growth_oscillation", "warning" if d.update_ratio > HEALTHY_UPDATE_RATIO else "problem",
               f"{overflows_after_growth} of {later} overflows came on the step right after the scale rose to "
               f"what the gradients' recent maxima allowed", overflows_after_growth=overflows_after_growth)
        b.recommend("larger_margin", f"Raise margin above {m} (or lengthen history): the backward's peak sits "
                    "further above the parameter gradients' maximum than the margin allows",
                    f"{overflows_after_growth} overflows followed a rise of the scale", "growth_oscillation")
        return
    b.find("growth_oscillation", "warning" if d.update_ratio > HEALTHY_UPDATE_RATIO else "problem",
           f"{overflows_after_growth} of {later} overflows came on the step right after the scale grew: it "
           f"oscillates between {fmt_scale(min(later_seq))} and {fmt_scale(max(later_seq))}"
           + (f" (growth_interval {gi})" if gi is not None else ""), overflows_after_growth=overflows_after_growth)
    b.recommend("longer_growth_interval",
                "Grow the scale less often: a longer growth_interval" + (f" than {gi}" if gi is not None else "")
                + " (GradScaler's default is 2000), or hysteresis",
                f"{overflows_after_growth} overflows followed a growth step and cost {overflows_after_growth} "
                "skipped updates", "growth_oscillation")


def _isolated_spike_findings(b: _Builder, d: Diagnosis, rows: list[_Step], spikes: list[tuple[int, float, float]],
                             scaler_cfg: dict) -> None:
    """Two or more one-step overflows (row index, scale before, scale after), each of which halved the scale."""
    drop = spikes[0][1] / spikes[-1][2]
    sev = "warning" if len(spikes) >= 3 else "info"
    b.find("isolated_spikes", sev,
           f"{len(spikes)} isolated one-step overflows (steps "
           f"{', '.join(str(rows[i].step) for i, _, _ in spikes[:6])}"
           f"{', ...' if len(spikes) > 6 else ''}) each halved the scale, from {fmt_scale(spikes[0][1])} to "
           f"{fmt_scale(spikes[-1][2])} (2^{int(round(math.log2(drop)))} lower)", spikes=len(spikes),
           from_scale=spikes[0][1], to_scale=spikes[-1][2])
    if sev != "warning":
        return
    if d.policy == "hysteresis":
        h = scaler_cfg.get("hysteresis", 2)
        b.recommend("hysteresis", f"Raise hysteresis above {h}, or refill it on every clean step "
                    "(DeepSpeed's consecutive_hysteresis)",
                    f"hysteresis {h} did not absorb {len(spikes)} isolated spikes: Megatron's tracker "
                    "refills only when the scale grows", "isolated_spikes")
    else:
        b.recommend("hysteresis", "Use hysteresis (policy: hysteresis, hysteresis: 2): the scale drops "
                    "only after repeated overflows",
                    f"{len(spikes)} isolated one-step overflows each halved the scale, "
                    f"{fmt_scale(spikes[0][1])} -> {fmt_scale(spikes[-1][2])}", "isolated_spikes",
                    change={"policy": "hysteresis"})

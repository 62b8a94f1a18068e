"""The run-level rules of the diagnosis: reading the run directory, the step counts, the FP16 phase and its scale
numbers, the run's status, planted faults, the FP32 fallback, the loss's trend and its spikes."""
from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

from lab.diagnose.record import (DiagnoseError, Diagnosis, _Builder, _halvings, _pct, _read_census, _read_config,
                                 _read_metrics, _read_steps, _Step, _streaks, fmt_scale)

SPIKE_FACTOR = 5.0      # a loss this many times the median of the applied steps before it is a spike ...
SPIKE_WINDOW = 20       # ... over this many of them


def read_run(run_dir: Path) -> tuple[dict, list[_Step], bool, dict, list[dict] | None, list[str]]:
    """metrics.json, steps.csv (or steps.csv.partial), config.yaml, census.csv (None: absent), and notes on them."""
    if not run_dir.exists():
        raise DiagnoseError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise DiagnoseError(f"{run_dir}: not a directory")
    metrics = _read_metrics(run_dir / "metrics.json")
    notes: list[str] = []
    steps_path = run_dir / "steps.csv"
    if not steps_path.is_file() and (run_dir / "steps.csv.partial").is_file():
        steps_path = run_dir / "steps.csv.partial"
        notes.append("steps.csv was never published (the run crashed or is still running): read steps.csv.partial")
    if not steps_path.is_file():
        raise DiagnoseError(f"{run_dir / 'steps.csv'}: steps.csv is missing")
    steps, has_layer_column = _read_steps(steps_path)
    config = _read_config(run_dir / "config.yaml")
    census_path = run_dir / "census.csv"
    census = _read_census(census_path) if census_path.is_file() else None
    return metrics, steps, has_layer_column, config, census, notes


def learning_rate(train_cfg: dict, steps: list[_Step], at: int | None = None):
    """The learning rate the rules quote: the one steps.csv logged at row ``at`` (the step that matters, e.g. the
    first non-finite loss) or its last one, else config.yaml's ``train.lr`` (a recording without ``optimizer=``
    logs none); None when neither has it."""
    logged = [s.lr for s in steps[: None if at is None else at + 1] if s.lr is not None and math.isfinite(s.lr)]
    if logged:
        return logged[-1]
    lr = train_cfg.get("lr")
    return lr if isinstance(lr, (int, float)) else None


def count_steps(d: Diagnosis, steps: list[_Step], nonfinite: list[int]) -> tuple[int, int] | None:
    """Overflow and skipped steps, their streaks, non-finite losses and overflow layers. Returns the longest skip
    streak (start index, length), None when no step was skipped."""
    n = len(steps)
    overflow = [s.found_inf for s in steps]
    skipped = [s.skipped for s in steps]
    d.overflow_steps = sum(overflow)
    d.skipped_steps = sum(skipped)
    d.skip_rate = d.skipped_steps / n if n else 0.0
    d.update_ratio = (n - d.skipped_steps) / n if n else 0.0
    d.first_overflow_step = next((s.step for s in steps if s.found_inf), None)
    skip_streaks = _streaks(skipped)
    longest_skip = max(skip_streaks, key=lambda t: t[1]) if skip_streaks else None
    if longest_skip:
        d.longest_skip_streak, d.longest_skip_streak_start = longest_skip[1], steps[longest_skip[0]].step
    ovf_streaks = _streaks(overflow)
    d.initial_overflow_streak = ovf_streaks[0][1] if ovf_streaks and ovf_streaks[0][0] == 0 else 0
    # the same split as metrics.json: the descent from the initial scale, then what probing costs in training
    d.overflow_in_training = d.overflow_steps - d.initial_overflow_streak
    after = n - d.initial_overflow_streak
    d.overflow_per_1k = 1000.0 * d.overflow_in_training / after if after else None
    d.growth_attempts = sum(b.scale > a.scale for a, b in zip(steps, steps[1:]) if a.precision == b.precision)
    d.nonfinite_loss_steps = len(nonfinite)
    d.first_nonfinite_loss_step = steps[nonfinite[0]].step if nonfinite else None
    d.overflow_layers = dict(Counter(s.layer for s in steps if s.found_inf and s.layer).most_common())
    # after the first clean step: where overflows start once the scale has calibrated (growth probes, spikes)
    d.later_overflow_layers = dict(Counter(
        s.layer for s in steps[d.initial_overflow_streak:] if s.found_inf and s.layer).most_common())
    return longest_skip


def fp16_phase(d: Diagnosis, steps: list[_Step], metrics: dict) -> tuple[list[_Step], list[_Step]]:
    """The FP32 fallback step and the loss scale's numbers (start, final, min, max, halvings). Returns the FP16
    rows and the FP32 rows after the fallback."""
    fallback = metrics.get("fallback_step")
    d.fallback_step = fallback if isinstance(fallback, int) else None
    # the FP16 phase: every row up to and including the fallback step (the scale is forced to 1 after it)
    fp16_rows = ([s for s in steps if d.fallback_step is None or s.step <= d.fallback_step]
                 if d.precision == "fp16" else [])
    fp32_rows = [s for s in steps if d.fallback_step is not None and s.step > d.fallback_step]
    final_scale = metrics.get("final_scale")
    final_scale = float(final_scale) if isinstance(final_scale, (int, float)) else None
    seq = [s.scale for s in fp16_rows]               # the scale each FP16 step used ...
    if seq and d.fallback_step is None and final_scale is not None:
        seq.append(final_scale)                       # ... and the one after the last update
    if seq:
        d.init_scale, d.min_scale, d.max_scale = seq[0], min(seq), max(seq)
        d.final_scale = seq[-1]
        d.scale_halvings = _halvings(seq)
    else:
        d.final_scale = final_scale
        d.init_scale = steps[0].scale if steps else None
        d.min_scale = min((s.scale for s in steps), default=None)
        d.max_scale = max((s.scale for s in steps), default=None)
    return fp16_rows, fp32_rows


def run_status_findings(b: _Builder, d: Diagnosis, metrics: dict) -> None:
    """The run failed, diverged, or never completed a step."""
    if d.status == "failed":
        b.find("failed", "problem", f"training raised an error: {metrics.get('error', 'unknown error')}",
               error=metrics.get("error"))
    if d.status == "diverged" or metrics.get("diverged"):
        b.find("diverged", "problem", f"the run diverged: {d.diverged_reason or 'no reason recorded'}",
               reason=d.diverged_reason)
        from lab.scaling.policies.deepspeed import DEEPSPEED_FLOOR_MESSAGE
        if DEEPSPEED_FLOOR_MESSAGE in (d.diverged_reason or ""):
            b.recommend("lower_min_scale", "Lower min_scale (DeepSpeed's min_loss_scale), or train in bf16; "
                        "DeepSpeed's FP16 optimisers without ZeRO (policy deepspeed-fp16) stay at the minimum "
                        "instead of ending the run", "DeepSpeed's rule ends the run when a step overflows at "
                        "its minimum scale with the hysteresis spent", "diverged")
    if d.steps == 0:
        b.find("no_steps", "problem", "steps.csv holds no optimizer step: training never completed a step")


def planted_findings(b: _Builder, d: Diagnosis, steps: list[_Step], train_cfg: dict, metrics: dict) -> None:
    """A run with planted faults (train.faults, lab/run/faults.py): were they counted, at exactly their steps?"""
    faults = train_cfg.get("faults") or []
    if not faults:
        return
    ran = {s.step for s in steps}
    planned = sorted({f["step"] for f in faults if isinstance(f, dict) and isinstance(f.get("step"), int)})
    d.planted_steps = [s for s in planned if s in ran]
    overflow = [s.step for s in steps if s.found_inf]
    d.unplanted_overflow_steps = [s for s in overflow if s not in d.planted_steps]
    missed = [s for s in d.planted_steps if s not in overflow]
    fired = metrics.get("planted_steps")
    not_fired = [s for s in d.planted_steps if isinstance(fired, list) and s not in fired]
    msg = (f"faults planted at steps {', '.join(map(str, d.planted_steps)) or 'none that ran'} "
           f"({len(planned) - len(d.planted_steps)} planned after the last step)" if len(planned) > len(d.planted_steps)
           else f"faults planted at steps {', '.join(map(str, d.planted_steps))}")
    if missed or not_fired:
        b.find("planted_missed", "problem", msg + f"; no overflow was counted at {', '.join(map(str, missed))}"
               + (f" (the fault never fired at {', '.join(map(str, not_fired))})" if not_fired else ""),
               planted=d.planted_steps, missed=missed, not_fired=not_fired)
    else:
        b.find("planted", "info", msg + "; an overflow was counted at each of them"
               + (f", and at {len(d.unplanted_overflow_steps)} other steps (first "
                  f"{d.unplanted_overflow_steps[0]})" if d.unplanted_overflow_steps else ", and nowhere else"),
               planted=d.planted_steps, unplanted=d.unplanted_overflow_steps)


def fallback_finding(b: _Builder, d: Diagnosis, fp32_rows: list[_Step], scaler_cfg: dict) -> None:
    """The scaler gave up on FP16 and continued in FP32."""
    if d.fallback_step is not None:
        b.find("fp32_fallback", "warning",
               f"the scaler gave up on FP16 at step {d.fallback_step} after "
               f"{scaler_cfg.get('fp32_fallback_after', '?')} "
               f"consecutive skipped steps (scale then {fmt_scale(d.final_scale)}); {len(fp32_rows)} later steps "
               "ran in FP32, without FP16's speed or memory savings",
               fallback_step=d.fallback_step, fp32_steps=len(fp32_rows), scale_at_fallback=d.final_scale)


def loss_trend_findings(b: _Builder, steps: list[_Step]) -> None:
    """Is it learning at all? The mean loss of the first and last tenth of the applied steps."""
    finite = [s.loss for s in steps if math.isfinite(s.loss) and not s.skipped]
    if len(finite) >= 10:
        k = max(1, len(finite) // 10)
        first, last = sum(finite[:k]) / k, sum(finite[-k:]) / k
        if last >= first and len(finite) >= 100:
            b.find("not_learning", "warning", f"the training loss did not fall over {len(finite)} applied steps "
                   f"({first:.3g} -> {last:.3g}, first/last tenth)", first=first, last=last)
        else:
            b.find("loss_trend", "info", f"training loss {first:.3g} -> {last:.3g} (mean of the first/last tenth "
                   f"of {len(finite)} applied steps)", first=first, last=last)


def loss_spike_findings(b: _Builder, steps: list[_Step]) -> None:
    """Finite losses SPIKE_FACTOR times the median of the SPIKE_WINDOW applied steps before them, after which the
    loss came back (a bad batch, a data outlier): what the scaler made of each (overflow, skip)."""
    spikes, window = [], []
    for i, s in enumerate(steps):
        if not math.isfinite(s.loss):
            continue
        if len(window) >= SPIKE_WINDOW and s.loss > SPIKE_FACTOR * statistics.median(window) > 0:
            spikes.append((i, statistics.median(window)))
        elif not s.skipped:
            window = (window + [s.loss])[-SPIKE_WINDOW:]
    if not spikes:
        return
    back = [i for i, med in spikes if any(math.isfinite(t.loss) and t.loss <= 2 * med for t in steps[i + 1:])]
    if not back:  # the loss never returned: a divergence, not a spike (loss_nonfinite / not_learning say more)
        return
    first = steps[back[0]]
    handled = [i for i in back if steps[i].found_inf]
    b.find("loss_spike", "info",
           f"{len(back)} loss spike(s) the run recovered from (first at step {first.step}: loss {first.loss:.3g} "
           f"against a median of {spikes[0][1]:.3g} over the {SPIKE_WINDOW} applied steps before it); "
           + (f"{len(handled)} of them overflowed and were skipped, at a cost of one update each"
              if handled else "none overflowed"),
           steps=[steps[i].step for i in back], overflowed=[steps[i].step for i in handled],
           share=_pct(len(back) / len(steps)))

"""Diagnose a run directory: why is my loss NaN, why is this run not learning?

The package: here the entry, ``diagnose()``, with the run-level rules and the verdict; record.py (the Diagnosis
record, reading a run directory, the text and JSON reports), scale.py and census.py (the loss-scale and census
rules), replay.py (any policy replayed over a run: ``python -m lab replay``). It reads a run's files only; of the
lab it imports lab.core (files, fp16) and, inside the functions that replay, lab.scaling and lab.numerics.

Reads only what the run recorded (``metrics.json``, ``steps.csv``, ``config.yaml`` and, when present,
``census.csv``) and answers in plain words with numbers::

    from lab.diagnose import diagnose, format_text
    d = diagnose("results/runs/lm/fp16-noscale/seed0")
    print(format_text(d))          # or json.dumps(d.to_dict())

``python -m lab diagnose RUN_DIR [--json]`` prints the same. A missing or malformed run directory raises
:class:`DiagnoseError` (the CLI exits with status 2), naming the path.

What is looked at:

* ``steps.csv`` (one row per optimizer step): overflow steps (``found_inf``), skipped steps and streaks,
  the scale trajectory (halvings, collapse, runaway), non-finite losses, and the optional column
  ``first_nonfinite_layer`` (the layer whose gradient first became non-finite in backward order) and
  ``first_nonfinite_source`` (``activation_grad``: the gradient at its output; ``param_grad``: its weights').
* ``metrics.json``: status, diverged reason, final scale (after the last update), FP32 fallback step.
* ``config.yaml``: policy parameters and the learning rate, quoted in the recommendations.
* ``census.csv`` (optional): per-layer counts of values that underflow/overflow FP16. FP32 runs hold
  counterfactual rows (``at_scale`` 1, 128, 1024, 65536: what FP16 would lose at that scale); FP16 runs hold
  rows at the scale in use. The underflow fraction is ``underflow / total`` of the ``__total__`` row (or the
  sum over layers when there is none) at the latest census step.

* ``steps.csv``'s ``grad_amax`` (when recorded): an FP16 run that skipped steps is replayed under every registered
  policy; the ones that would have skipped fewer steps without flushing more are named (``replay_fewer_skips``).

Severity: ``problem`` (the run is broken), ``warning`` (it costs updates or range), ``info``. A run is
``healthy`` when its status is ok, more than 95 % of its steps updated the weights and no finding is a
problem or a warning.

The rules: run level, planted faults, overflow, layers, loss trend and the verdict here; the loss scale's
trajectory in lab/diagnose/scale.py; census.csv in lab/diagnose/census.py. The record, reading the run directory
and the text report: lab/diagnose/record.py.

``lab.diagnose`` is both this package and the function: ``lab.diagnose(run_dir)`` calls ``diagnose(run_dir)``.
"""
from __future__ import annotations

import math
import sys
import types
from collections import Counter
from pathlib import Path

# the record, reading and printing (lab/diagnose/record.py) and the rules' thresholds are re-exported for callers
from lab.diagnose.record import (CENSUS_COLUMNS, CENSUS_TOTAL, HEALTHY_UPDATE_RATIO, SEVERITIES,  # noqa: F401
                                 DiagnoseError, Diagnosis, Finding, Recommendation, _Builder, _halvings, _pct,
                                 _read_census, _read_config, _read_hist, _read_metrics, _read_steps, _Step,
                                 _steps_span, _streaks, fmt_scale, fmt_scale_value, format_json, format_text)
from lab.diagnose.adapters import adapter_findings
from lab.diagnose.census import FLUSH_MATERIAL, UNDERFLOW_LARGE, census_findings
from lab.diagnose.scale import ALERT_STREAK, COLLAPSE_FACTOR, LONG_STREAK, RUNAWAY_SCALE, scale_findings  # noqa: F401


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Read a run directory and explain what went wrong (or that nothing did)."""
    run_dir = Path(run_dir)
    metrics, steps, has_layer_column, config, census, notes = _read_run(run_dir)
    mode_cfg = config.get("mode") if isinstance(config.get("mode"), dict) else {}
    scaler_cfg = mode_cfg.get("scaler") if isinstance(mode_cfg.get("scaler"), dict) else {}
    train_cfg = config.get("train") if isinstance(config.get("train"), dict) else {}
    precision = metrics.get("precision") or mode_cfg.get("precision") or (steps[0].precision if steps else None)
    d = Diagnosis(run_dir=str(run_dir), verdict="issues", headline="", model=metrics.get("model"),
                  mode=metrics.get("mode"), seed=metrics.get("seed"), precision=precision,
                  policy=metrics.get("scaler") or scaler_cfg.get("policy") or "none", status=metrics.get("status"),
                  diverged_reason=metrics.get("diverged_reason"), steps=len(steps), alerts=metrics.get("alerts"),
                  notes=notes)
    nonfinite = [i for i, s in enumerate(steps) if not math.isfinite(s.loss)]    # row indices
    longest_skip = _count_steps(d, steps, nonfinite)
    fp16_rows, fp32_rows = _fp16_phase(d, steps, metrics)

    b = _Builder()
    _run_status_findings(b, d, metrics)
    _nonfinite_loss_findings(b, d, steps, nonfinite, fp16_rows, fp32_rows, train_cfg.get("lr"))
    _planted_findings(b, d, steps, train_cfg, metrics)
    _overflow_findings(b, d, steps, fp16_rows, longest_skip)
    if fp16_rows:
        scale_findings(b, d, fp16_rows, scaler_cfg)
    _fallback_finding(b, d, fp32_rows, scaler_cfg)
    _overflow_layer_findings(b, d, steps, has_layer_column)
    if census is None:
        if precision in ("fp16", "fp32"):
            notes.append("no census.csv: underflow was not measured")
    elif not census:
        notes.append("census.csv holds no rows: underflow was not measured")
    else:
        census_findings(b, d, census, _read_hist(run_dir / "grad_hist.csv"))
    adapter_findings(b, d, run_dir, steps, census, _read_hist(run_dir / "grad_hist.csv"))
    _loss_trend_findings(b, steps)
    _replay_findings(b, d, run_dir)
    _verdict(b, d, metrics)
    d.findings, d.recommendations = b.findings, b.recs
    return d


def _read_run(run_dir: Path) -> tuple[dict, list[_Step], bool, dict, list[dict] | None, list[str]]:
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


def _count_steps(d: Diagnosis, steps: list[_Step], nonfinite: list[int]) -> tuple[int, int] | None:
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


def _fp16_phase(d: Diagnosis, steps: list[_Step], metrics: dict) -> tuple[list[_Step], list[_Step]]:
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


def _run_status_findings(b: _Builder, d: Diagnosis, metrics: dict) -> None:
    """The run failed, diverged, or never completed a step."""
    if d.status == "failed":
        b.find("failed", "problem", f"training raised an error: {metrics.get('error', 'unknown error')}",
               error=metrics.get("error"))
    if d.status == "diverged" or metrics.get("diverged"):
        b.find("diverged", "problem", f"the run diverged: {d.diverged_reason or 'no reason recorded'}",
               reason=d.diverged_reason)
        from lab.scaling.deepspeed import DEEPSPEED_FLOOR_MESSAGE
        if DEEPSPEED_FLOOR_MESSAGE in (d.diverged_reason or ""):
            b.recommend("lower_min_scale", "Lower min_scale (DeepSpeed's min_loss_scale), or train in bf16; "
                        "DeepSpeed's FP16 optimisers without ZeRO (policy deepspeed-fp16) stay at the minimum "
                        "instead of ending the run", "DeepSpeed's rule ends the run when a step overflows at "
                        "its minimum scale with the hysteresis spent", "diverged")
    if d.steps == 0:
        b.find("no_steps", "problem", "steps.csv holds no optimizer step: training never completed a step")


#: how much more of the parameter gradients (a share) a replayed policy may flush and still be recommended
REPLAY_FLUSH_SLACK = 1e-3


def _replay_findings(b: _Builder, d: Diagnosis, run_dir: Path) -> None:
    """An FP16 run that skipped steps: which registered policy, replayed over this run (lab/diagnose/replay.py),
    would have skipped fewer without flushing more of the parameter gradients. Not when a loss was non-finite (no
    loss scale helps a forward pass that overflowed) or the run fell back to FP32."""
    if d.precision != "fp16" or not d.skipped_steps or d.nonfinite_loss_steps or d.fallback_step is not None:
        return
    from lab.diagnose.replay import ReplayError, replay_run
    try:
        rows = [r for r in replay_run(run_dir) if r["ended_at"] is None]
    except ReplayError:  # a run recorded before grad_amax: nothing to replay
        return
    own = next((r for r in rows if r["policy"] == d.policy), None)
    own_flush = (own or {}).get("flushed_param") or 0.0
    # fewer skips, and at most REPLAY_FLUSH_SLACK more of the parameter gradients flushed than this policy's replay
    better = sorted((r for r in rows if r["skipped_steps"] < d.skipped_steps and r["policy"] != d.policy
                     and (r["flushed_param"] or 0.0) <= own_flush + REPLAY_FLUSH_SLACK),
                    key=lambda r: (r["skipped_steps"], r["flushed_param"] or 0.0))
    if not better:
        return
    text = ", ".join(f"{r['policy']} {r['skipped_steps']}" for r in better[:3])
    b.find("replay_fewer_skips", "info", f"replayed over this run's gradients (python -m lab replay), these "
           f"policies at their defaults skip fewer steps than this run's {d.skipped_steps}: {text}",
           policies={r["policy"]: r["skipped_steps"] for r in better})
    best = better[0]
    b.recommend("replay_policy", f"Try policy {best['policy']} (replay: {best['skipped_steps']} skipped steps "
                f"instead of {d.skipped_steps})", f"replayed, it flushes {_pct(best['flushed_param'] or 0.0)} of the "
                f"parameter gradients against {_pct(own_flush)} for {d.policy}; replay is exact for the policy's rule "
                "and an approximation for the run (docs/replay.md)", "replay_fewer_skips")


def _nonfinite_loss_findings(b: _Builder, d: Diagnosis, steps: list[_Step], nonfinite: list[int],
                             fp16_rows: list[_Step], fp32_rows: list[_Step], lr) -> None:
    """Non-finite loss: the forward pass, which no loss scale reaches (or weights that blew up)."""
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
    if fwd16:
        chased = _halvings([s.scale for s in fp16_rows if s.step >= steps[nonfinite[0]].step])
        msg += ("; a non-finite loss comes from the forward pass, so no loss scale can prevent it"
                + (f" (the scaler halved the scale {chased} times chasing it)"
                   if d.policy not in ("none", "static") else ""))
    b.find("loss_nonfinite", "problem", msg, steps=len(nonfinite), first_step=d.first_nonfinite_loss_step,
           to_the_end=tail, applied_updates_before=applied_before, after_fallback=len(after_fb))
    big_lr = isinstance(lr, (int, float)) and lr >= 1.0
    if after_fb:
        b.recommend("lower_lr", f"Lower the learning rate (now {lr:g})" if isinstance(lr, (int, float))
                    else "Lower the learning rate",
                    f"after the FP32 fallback at step {fb} the loss was still non-finite on "
                    f"{len(after_fb)} of {len(fp32_rows)} FP32 steps: precision is not the cause, the "
                    "weights themselves blew up", "loss_nonfinite")
    elif big_lr:
        b.recommend("lower_lr", f"Lower the learning rate (now {lr:g})",
                    f"the loss was finite for {nonfinite[0]} step(s) and became non-finite after "
                    f"{applied_before} applied update(s); with lr {lr:g} one update moves weights past "
                    "FP16's largest value (65504)", "loss_nonfinite")
    if fwd16 and not after_fb:
        b.recommend("bf16", "Train in bf16 (FP32's range) or enable fp32_fallback_after (e.g. 10)",
                    f"the FP16 forward pass produced a non-finite loss on {len(fwd16)} steps; if the loss stays "
                    "finite in bf16/FP32, FP16's range was the cause, otherwise look at the learning rate "
                    "and the data", "loss_nonfinite")


def _planted_findings(b: _Builder, d: Diagnosis, steps: list[_Step], train_cfg: dict, metrics: dict) -> None:
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


def _overflow_findings(b: _Builder, d: Diagnosis, steps: list[_Step], fp16_rows: list[_Step],
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


def _fallback_finding(b: _Builder, d: Diagnosis, fp32_rows: list[_Step], scaler_cfg: dict) -> None:
    """The scaler gave up on FP16 and continued in FP32."""
    if d.fallback_step is not None:
        b.find("fp32_fallback", "warning",
               f"the scaler gave up on FP16 at step {d.fallback_step} after "
               f"{scaler_cfg.get('fp32_fallback_after', '?')} "
               f"consecutive skipped steps (scale then {fmt_scale(d.final_scale)}); {len(fp32_rows)} later steps "
               "ran in FP32, without FP16's speed or memory savings",
               fallback_step=d.fallback_step, fp32_steps=len(fp32_rows), scale_at_fallback=d.final_scale)


def _overflow_layer_findings(b: _Builder, d: Diagnosis, steps: list[_Step], has_layer_column: bool) -> None:
    """Which layers' gradients became non-finite first, overall and after the initial overflow streak."""
    if d.overflow_layers:
        top = list(d.overflow_layers.items())[:3]
        with_layer = sum(d.overflow_layers.values())
        later = list(d.later_overflow_layers.items())[:3]
        after = ""
        if later and d.initial_overflow_streak:
            n_later = sum(d.later_overflow_layers.values())
            after = (f"; after the first clean step (step {steps[d.initial_overflow_streak].step}): " + ", ".join(
                f"{name} on {c} of {n_later}" for name, c in later))
        b.find("overflow_layers", "info", "first non-finite gradient (backward order): " + ", ".join(
               f"{name} on {c} of {with_layer} overflow steps" for name, c in top) + after, layers=dict(top),
               later_layers=dict(later))
    elif d.overflow_steps and d.precision == "fp16" and not has_layer_column:
        d.notes.append("steps.csv has no first_nonfinite_layer column: which layer overflowed was not recorded")


def _loss_trend_findings(b: _Builder, steps: list[_Step]) -> None:
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


def _underflow_note(d: Diagnosis) -> str:
    """Why an FP16 run's underflow is no finding: the FP32 replay's numbers, or the census's (older runs)."""
    if d.fp16_loss:
        worst = max(v["flushed"] for v in d.fp16_loss["sources"].values())
        return (f" (FP16 flushed at most {_pct(worst)} of the gradients FP32 keeps, under the "
                f"{_pct(FLUSH_MATERIAL)} that the study's losses point to: docs/census.md)")
    return f" (underflow below {_pct(UNDERFLOW_LARGE)})" if d.census and d.precision == "fp16" else ""


def _verdict(b: _Builder, d: Diagnosis, metrics: dict) -> None:
    """Sort the findings (problems first), then the verdict and the headline; a healthy run is told so first."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    generic = ("diverged", "failed", "overflow", "low_update_ratio")   # specific causes first within a severity
    b.findings.sort(key=lambda f: (order[f.severity], f.code in generic))
    issues = [f for f in b.findings if f.severity in ("problem", "warning")]
    if d.status == "failed":
        d.verdict = "failed"
    elif d.status == "diverged" or metrics.get("diverged"):
        d.verdict = "diverged"
    elif not issues and d.steps and d.update_ratio > HEALTHY_UPDATE_RATIO:
        d.verdict = "healthy"
    else:
        d.verdict = "issues"
    # a healthy run is told there is nothing to change, unless FP16 lost gradients a higher scale would keep
    # (advice from the FP32 replay, below the warning level); other info-level advice is counterfactual
    advised = any("fp16_underflow" in r.based_on for r in b.recs)
    if d.verdict == "healthy" and not advised:
        b.recs = [Recommendation("healthy", "Nothing to change",
                                 f"{_pct(d.update_ratio)} of {d.steps} steps updated the weights (healthy: > "
                                 f"{_pct(HEALTHY_UPDATE_RATIO)}) and no finding is a problem or a warning"
                                 + _underflow_note(d))] + b.recs
        d.headline = f"healthy: {_pct(d.update_ratio)} of {d.steps} steps updated the weights"
    elif d.verdict == "healthy":
        d.headline = (f"healthy: {_pct(d.update_ratio)} of {d.steps} steps updated the weights; FP16 flushed "
                      f"{_pct(max(v['flushed'] for v in d.fp16_loss['sources'].values()))} of the gradients FP32 "
                      "keeps, which a higher loss scale would keep")
    else:
        reason = (f" ({d.diverged_reason})" if d.verdict == "diverged" and d.diverged_reason else
                  f" ({metrics.get('error')})" if d.verdict == "failed" and metrics.get("error") else "")
        top = next((f for f in issues if f.code not in ("diverged", "failed")), None)
        d.headline = f"{d.verdict}{reason}" + (f": {top.message}" if top else
                                                f": {_pct(d.update_ratio)} of steps updated the weights")


class _CallableModule(types.ModuleType):
    """The package's module type: calling the package, ``lab.diagnose(run_dir)``, is ``diagnose(run_dir)``."""

    def __call__(self, run_dir: str | Path) -> Diagnosis:
        return diagnose(run_dir)


sys.modules[__name__].__class__ = _CallableModule

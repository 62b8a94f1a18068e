"""Diagnose a run directory: why is my loss NaN, why is this run not learning?

Reads only what the run recorded (``metrics.json``, ``steps.csv``, ``config.yaml`` and, when present,
``census.csv``) and answers in plain words with numbers::

    from lab.diagnose import diagnose, format_text
    d = diagnose("results/runs/vit/fp16-hysteresis/seed0")
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

Severity: ``problem`` (the run is broken), ``warning`` (it costs updates or range), ``info``. A run is
``healthy`` when its status is ok, more than 95 % of its steps updated the weights and no finding is a
problem or a warning.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

# the record, reading and printing (lab/diagnosis.py); format_text/format_json are re-exported for callers
from lab.diagnosis import (CENSUS_COLUMNS, CENSUS_TOTAL, HEALTHY_UPDATE_RATIO, DiagnoseError,  # noqa: F401
                           Diagnosis, Finding, Recommendation, _pct, _read_census, _read_config, _read_metrics,
                           _read_steps, _Step, _steps_span, _streaks, fmt_scale, fmt_scale_value, format_json,
                           format_text)

ALERT_STREAK = 3                 # consecutive overflows that count as a streak (the engine's alert_after)
LONG_STREAK = 10                 # an initial streak this long (or >= 5 % of the run) is worth a warning
COLLAPSE_FACTOR = 2.0 ** 10      # the scale fell this far below the first scale that worked
RUNAWAY_SCALE = 2.0 ** 24        # the scale grew above this (or to inf)
UNDERFLOW_LARGE = 0.01           # >= 1 % of a tensor class's values flush to zero in FP16
SEVERITIES = ("problem", "warning", "info")


def _planted_findings(b: _Builder, d: Diagnosis, steps: list[_Step], train_cfg: dict, metrics: dict) -> None:
    """A run with planted faults (train.faults, lab/faults.py): were they counted, at exactly their steps?"""
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


# --- the diagnosis ---------------------------------------------------------------------------------------
class _Builder:
    def __init__(self):
        self.findings: list[Finding] = []
        self.recs: list[Recommendation] = []

    def find(self, code, severity, message, **evidence):
        assert severity in SEVERITIES
        self.findings.append(Finding(code, severity, message, evidence))

    def recommend(self, code, action, evidence, *based_on):
        if all(r.code != code for r in self.recs):
            self.recs.append(Recommendation(code, action, evidence, list(based_on)))


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Read a run directory and explain what went wrong (or that nothing did)."""
    run_dir = Path(run_dir)
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

    b = _Builder()
    mode_cfg = config.get("mode") if isinstance(config.get("mode"), dict) else {}
    scaler_cfg = mode_cfg.get("scaler") if isinstance(mode_cfg.get("scaler"), dict) else {}
    train_cfg = config.get("train") if isinstance(config.get("train"), dict) else {}
    precision = metrics.get("precision") or mode_cfg.get("precision") or (steps[0].precision if steps else None)
    policy = metrics.get("scaler") or scaler_cfg.get("policy") or "none"
    status = metrics.get("status")
    n = len(steps)
    d = Diagnosis(run_dir=str(run_dir), verdict="issues", headline="", model=metrics.get("model"),
                  mode=metrics.get("mode"), seed=metrics.get("seed"), precision=precision, policy=policy,
                  status=status, diverged_reason=metrics.get("diverged_reason"), steps=n,
                  alerts=metrics.get("alerts"), notes=notes)
    fp16 = precision == "fp16"

    # ---- counters -------------------------------------------------------------------------------------
    overflow = [s.found_inf for s in steps]
    skipped = [s.skipped for s in steps]
    d.overflow_steps = sum(overflow)
    d.skipped_steps = sum(skipped)
    d.skip_rate = d.skipped_steps / n if n else 0.0
    d.update_ratio = (n - d.skipped_steps) / n if n else 0.0
    d.first_overflow_step = next((s.step for s in steps if s.found_inf), None)
    skip_streaks = _streaks(skipped)
    if skip_streaks:
        start, length = max(skip_streaks, key=lambda t: t[1])
        d.longest_skip_streak, d.longest_skip_streak_start = length, steps[start].step
    ovf_streaks = _streaks(overflow)
    d.initial_overflow_streak = ovf_streaks[0][1] if ovf_streaks and ovf_streaks[0][0] == 0 else 0
    fallback = metrics.get("fallback_step")
    d.fallback_step = fallback if isinstance(fallback, int) else None
    nonfinite = [i for i, s in enumerate(steps) if not math.isfinite(s.loss)]
    d.nonfinite_loss_steps = len(nonfinite)
    d.first_nonfinite_loss_step = steps[nonfinite[0]].step if nonfinite else None
    d.overflow_layers = dict(Counter(s.layer for s in steps if s.found_inf and s.layer).most_common())
    # after the first clean step: where overflows start once the scale has calibrated (growth probes, spikes)
    d.later_overflow_layers = dict(Counter(
        s.layer for s in steps[d.initial_overflow_streak:] if s.found_inf and s.layer).most_common())

    # the FP16 phase: every row up to and including the fallback step (the scale is forced to 1 after it)
    fp16_rows = [s for s in steps if d.fallback_step is None or s.step <= d.fallback_step] if fp16 else []
    fp32_rows = [s for s in steps if d.fallback_step is not None and s.step > d.fallback_step]
    final_scale = metrics.get("final_scale")
    final_scale = float(final_scale) if isinstance(final_scale, (int, float)) else None
    seq = [s.scale for s in fp16_rows]               # the scale each FP16 step used ...
    if seq and d.fallback_step is None and final_scale is not None:
        seq.append(final_scale)                       # ... and the one after the last update
    if seq:
        d.init_scale, d.min_scale, d.max_scale = seq[0], min(seq), max(seq)
        d.final_scale = seq[-1]
        d.scale_halvings = sum(1 for a, c in zip(seq, seq[1:]) if c < a)
    else:
        d.final_scale = final_scale
        d.init_scale = steps[0].scale if steps else None
        d.min_scale = min((s.scale for s in steps), default=None)
        d.max_scale = max((s.scale for s in steps), default=None)
    lr = train_cfg.get("lr")

    # ---- run status -----------------------------------------------------------------------------------
    if status == "failed":
        b.find("failed", "problem", f"training raised an error: {metrics.get('error', 'unknown error')}",
               error=metrics.get("error"))
    if status == "diverged" or metrics.get("diverged"):
        b.find("diverged", "problem", f"the run diverged: {d.diverged_reason or 'no reason recorded'}",
               reason=d.diverged_reason)
    if n == 0:
        b.find("no_steps", "problem", "steps.csv holds no optimizer step: training never completed a step")

    # ---- non-finite loss: the forward pass, which no loss scale reaches ------------------------------
    if nonfinite:
        fwd16 = [i for i in nonfinite if fp16 and (d.fallback_step is None or steps[i].step <= d.fallback_step)]
        after_fb = [i for i in nonfinite if d.fallback_step is not None and steps[i].step > d.fallback_step]
        tail = len(steps) - nonfinite[-1] == 1 and all(not math.isfinite(s.loss) for s in steps[nonfinite[0]:])
        msg = (f"the training loss was NaN/inf on {len(nonfinite)} of {n} steps, first at step "
               f"{d.first_nonfinite_loss_step}"
               + (" and on every step after it" if tail and len(nonfinite) > 1 else ""))
        applied_before = sum(1 for s in steps[:nonfinite[0]] if not s.skipped)
        if fwd16:
            msg += ("; a non-finite loss comes from the forward pass, so no loss scale can prevent it"
                    + (f" (the scaler halved the scale {_halvings_in(fp16_rows, steps[nonfinite[0]].step)} times "
                       f"chasing it)" if policy not in ("none", "static") else ""))
        b.find("loss_nonfinite", "problem", msg, steps=len(nonfinite), first_step=d.first_nonfinite_loss_step,
               to_the_end=tail, applied_updates_before=applied_before, after_fallback=len(after_fb))
        big_lr = isinstance(lr, (int, float)) and lr >= 1.0
        if after_fb:
            b.recommend("lower_lr", f"Lower the learning rate (now {lr:g})" if isinstance(lr, (int, float))
                        else "Lower the learning rate",
                        f"after the FP32 fallback at step {d.fallback_step} the loss was still non-finite on "
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

    _planted_findings(b, d, steps, train_cfg, metrics)

    # ---- overflow and skipping ------------------------------------------------------------------------
    if d.overflow_steps:
        skip_part = (f"{d.skipped_steps} skipped (skip rate {_pct(d.skip_rate)}), longest skip streak "
                     f"{d.longest_skip_streak} ({_steps_span(steps, *max(skip_streaks, key=lambda t: t[1]))})"
                     if d.skipped_steps else "none skipped")
        sev = ("problem" if d.skip_rate >= 0.5 else "warning" if d.update_ratio <= HEALTHY_UPDATE_RATIO else "info")
        b.find("overflow", sev, f"{d.overflow_steps} of {n} steps had inf/nan gradients (first at step "
               f"{d.first_overflow_step}); {skip_part}; {_pct(d.update_ratio)} of steps updated the weights",
               overflow_steps=d.overflow_steps, skipped_steps=d.skipped_steps, skip_rate=d.skip_rate,
               update_ratio=d.update_ratio, longest_skip_streak=d.longest_skip_streak)
    elif n and d.update_ratio <= HEALTHY_UPDATE_RATIO:
        b.find("low_update_ratio", "warning", f"only {_pct(d.update_ratio)} of steps updated the weights "
               f"(healthy: > {_pct(HEALTHY_UPDATE_RATIO)})", update_ratio=d.update_ratio)

    applied_ovf = [s for s in fp16_rows if s.found_inf and not s.skipped]
    if applied_ovf:
        b.find("overflow_applied", "problem" if nonfinite else "warning",
               f"{len(applied_ovf)} steps with inf/nan gradients were applied anyway (policy {policy} does not "
               "skip): non-finite values reached the optimizer", steps=len(applied_ovf))
        b.recommend("skip_on_overflow", "Use a policy that skips overflowing steps (static, dynamic or "
                    "hysteresis; for 'none': skip_on_overflow: true)",
                    f"{len(applied_ovf)} updates were computed from inf/nan gradients", "overflow_applied")

    if fp16 and fp16_rows:
        _scale_findings(b, d, fp16_rows, policy, scaler_cfg)

    # ---- FP32 fallback --------------------------------------------------------------------------------
    if d.fallback_step is not None:
        b.find("fp32_fallback", "warning",
               f"the scaler gave up on FP16 at step {d.fallback_step} after "
               f"{scaler_cfg.get('fp32_fallback_after', '?')} "
               f"consecutive skipped steps (scale then {fmt_scale(d.final_scale)}); {len(fp32_rows)} later steps "
               "ran in FP32, without FP16's speed or memory savings",
               fallback_step=d.fallback_step, fp32_steps=len(fp32_rows), scale_at_fallback=d.final_scale)

    # ---- layers ---------------------------------------------------------------------------------------
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
    elif d.overflow_steps and fp16 and not has_layer_column:
        notes.append("steps.csv has no first_nonfinite_layer column: which layer overflowed was not recorded")

    # ---- census: underflow / overflow per layer -------------------------------------------------------
    if census is None:
        if fp16 or precision == "fp32":
            notes.append("no census.csv: underflow was not measured")
    elif not census:
        notes.append("census.csv holds no rows: underflow was not measured")
    else:
        _census_findings(b, d, census, precision)

    # ---- loss trend (is it learning at all?) ----------------------------------------------------------
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

    # ---- verdict --------------------------------------------------------------------------------------
    order = {s: i for i, s in enumerate(SEVERITIES)}
    generic = ("diverged", "failed", "overflow", "low_update_ratio")   # specific causes first within a severity
    b.findings.sort(key=lambda f: (order[f.severity], f.code in generic))
    issues = [f for f in b.findings if f.severity in ("problem", "warning")]
    if status == "failed":
        d.verdict = "failed"
    elif status == "diverged" or metrics.get("diverged"):
        d.verdict = "diverged"
    elif not issues and n and d.update_ratio > HEALTHY_UPDATE_RATIO:
        d.verdict = "healthy"
    else:
        d.verdict = "issues"
    if d.verdict == "healthy":   # what remains is advice from info-level findings (a counterfactual census)
        b.recs = [Recommendation("healthy", "Nothing to change",
                                 f"{_pct(d.update_ratio)} of {n} steps updated the weights (healthy: > "
                                 f"{_pct(HEALTHY_UPDATE_RATIO)}) and no finding is a problem or a warning"
                                 + (f" (underflow below {_pct(UNDERFLOW_LARGE)})" if d.census and precision == "fp16"
                                    else ""))] + b.recs
        d.headline = f"healthy: {_pct(d.update_ratio)} of {n} steps updated the weights"
    else:
        reason = (f" ({d.diverged_reason})" if d.verdict == "diverged" and d.diverged_reason else
                  f" ({metrics.get('error')})" if d.verdict == "failed" and metrics.get("error") else "")
        top = next((f for f in issues if f.code not in ("diverged", "failed")), None)
        d.headline = f"{d.verdict}{reason}" + (f": {top.message}" if top else
                                                f": {_pct(d.update_ratio)} of steps updated the weights")
    d.findings, d.recommendations = b.findings, b.recs
    return d


def _halvings_in(rows: list[_Step], from_step: int) -> int:
    seq = [s.scale for s in rows if s.step >= from_step]
    return sum(1 for a, c in zip(seq, seq[1:]) if c < a)


def _scale_findings(b: _Builder, d: Diagnosis, rows: list[_Step], policy, scaler_cfg: dict) -> None:
    """Initial overflow streak, collapse, runaway, isolated spikes, overflow right after growth."""
    n = len(rows)
    flags = [s.found_inf for s in rows]
    streaks = _streaks(flags)
    seq = [s.scale for s in rows] + ([d.final_scale] if d.fallback_step is None and d.final_scale is not None else [])
    init = seq[0]
    dynamic = len(set(seq)) > 1
    loss_ok = lambda lo, hi: all(math.isfinite(s.loss) for s in rows[lo:hi])  # noqa: E731

    # the scale of the first clean step after a leading overflow streak: the first scale that worked
    initial = streaks[0][1] if streaks and streaks[0][0] == 0 else 0
    working = rows[initial].scale if initial < n else None
    if initial >= ALERT_STREAK and loss_ok(0, initial):
        sev = ("problem" if initial >= 0.5 * n else "warning" if initial >= LONG_STREAK or initial >= 0.05 * n
               else "info")
        if working is not None and dynamic:
            msg = (f"the first {initial} steps overflowed while the scale fell from {fmt_scale(init)} to "
                   f"{fmt_scale(working)}: init_scale {fmt_scale(init)} is too high for this model")
            action = f"Lower init_scale to {fmt_scale_value(working)}"
            why = f"step {rows[initial].step} was the first clean step, at scale {fmt_scale(working)}; the {initial} " \
                  f"steps before it were skipped"
        elif working is None and dynamic:
            msg = (f"every one of the {n} steps overflowed while the scale halved from {fmt_scale(init)} to "
                   f"{fmt_scale(seq[-1])}; the scaler never reached a scale that works")
            action = f"Lower init_scale to {fmt_scale_value(seq[-1])} or below"
            why = (f"{initial} consecutive overflows from init_scale {fmt_scale(init)}; even "
                   f"{fmt_scale(min(s.scale for s in rows))} overflowed and the loss stayed finite, "
                   "so the scale, not the model, was the problem")
        else:
            msg = (f"the first {initial} steps" if working is not None else f"all {n} steps") + \
                  f" overflowed at the constant scale {fmt_scale(init)}"
            action = ("Lower the loss scale (e.g. a static scale of 1024 or 128, the study's static modes) or use "
                      "dynamic scaling"
                      if init > 1 else "Train in bf16")
            why = f"{initial} consecutive steps overflowed at scale {fmt_scale(init)} with a finite loss"
        if sev == "info":
            msg += f"; harmless here ({initial} of {n} steps skipped)"
        b.find("init_scale_too_high", sev, msg, streak=initial, init_scale=init, first_working_scale=working)
        if sev != "info":
            b.recommend("lower_init_scale" if dynamic else "lower_scale", action, why, "init_scale_too_high")

    # collapse: to <= 1, or far below the first scale that worked, or halving to the end after it worked
    after = seq[initial:] if working is not None else []
    low = min(seq)
    ref = working if working is not None else None
    ending = streaks[-1] if streaks and streaks[-1][0] + streaks[-1][1] == n and streaks[-1][0] > 0 else None
    ending_halvings = sum(1 for a, c in zip(seq[ending[0]:], seq[ending[0] + 1:]) if c < a) if ending else 0
    collapse = []
    if init > 1 and low <= 1:
        collapse.append(f"to {fmt_scale(low)} (<= 1: it no longer amplifies anything)")
    if ref and after and ref / min(after) >= COLLAPSE_FACTOR:
        collapse.append(f"2^{int(round(math.log2(ref / min(after))))} below {fmt_scale(ref)}, "
                        "the first scale that worked")
    if ending and ending[1] >= 5 and ending_halvings >= 4:
        collapse.append(f"halving on each of the last {ending[1]} steps ({_steps_span(rows, *ending)}) "
                        + ("before the FP32 fallback" if d.fallback_step is not None else "without recovering"))
    if collapse:
        halv = d.scale_halvings
        b.find("scale_collapse", "problem",
               f"the loss scale collapsed from {fmt_scale(init)} to {fmt_scale(low)} ({halv} halvings): "
               + "; ".join(collapse), init_scale=init, min_scale=low, halvings=halv)
        low_ovf = [s for s in rows if s.found_inf and math.isfinite(s.loss)]
        if not d.nonfinite_loss_steps and low_ovf:
            b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                        f"gradients kept overflowing while the scale fell to {fmt_scale(low)}: the values exceed "
                        "FP16's range however small the scale", "scale_collapse")
        if scaler_cfg.get("fp32_fallback_after") is None and not d.nonfinite_loss_steps:
            b.recommend("fp32_fallback", "Enable fp32_fallback_after: 10 (the fp16-dynamic-fallback mode)",
                        f"the scaler kept halving ({d.scale_halvings} times, down to {fmt_scale(low)}) and skipping "
                        f"({d.longest_skip_streak} steps in a row) instead of continuing in FP32", "scale_collapse")

    # runaway: the scale grew to > 2^24 or inf
    grown = [(i, x) for i, x in enumerate(seq) if x > init and (x > RUNAWAY_SCALE or math.isinf(x))]
    if grown:
        top = max(x for _, x in grown)
        b.find("scale_runaway", "warning" if math.isfinite(top) else "problem",
               f"the loss scale ran away from {fmt_scale(init)} to {fmt_scale(top)} (> 2^24 or inf): with no "
               "overflow to stop it, gradients are so small (or zero) that the scale only grows", max_scale=top)
        b.recommend("cap_scale", "Cap the scale (max_scale, e.g. 65536: the warmup or bounded policies)",
                    f"the scale reached {fmt_scale(top)}; a later real gradient would overflow at once and "
                    "skip a long streak to come back", "scale_runaway")

    # overflow at scale <= 1: the values themselves exceed FP16's range
    low_scale_ovf = [s for s in rows if s.found_inf and s.scale <= 1 and math.isfinite(s.loss)]
    if low_scale_ovf:
        sev = "problem" if len(low_scale_ovf) >= max(2, 0.05 * n) else "warning"
        b.find("overflow_at_low_scale", sev,
               f"{len(low_scale_ovf)} steps overflowed at scale <= 1 with a finite loss (first at step "
               f"{low_scale_ovf[0].step}): gradients exceed FP16's 65504 without any scaling",
               steps=len(low_scale_ovf))
        b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                    f"{len(low_scale_ovf)} steps overflowed even at scale <= 1, so no loss scale fits",
                    "overflow_at_low_scale")
        if scaler_cfg.get("fp32_fallback_after") is None:
            b.recommend("fp32_fallback", "Or enable fp32_fallback_after: 10 to continue in FP32",
                        f"{len(low_scale_ovf)} overflows at scale <= 1", "overflow_at_low_scale")

    # isolated one-step overflows after the start, each halving the scale
    spikes = [(i, seq[i], seq[i + 1]) for i, length in streaks if length == 1 and i >= max(initial, 1)
              and i + 1 < len(seq) and seq[i + 1] < seq[i] and math.isfinite(rows[i].loss)]
    after_growth = [i for i in range(1, n) if flags[i] and rows[i].scale > rows[i - 1].scale]
    later = sum(flags[initial:])
    if len(after_growth) >= ALERT_STREAK and len(after_growth) * 2 >= later:
        gi = scaler_cfg.get("growth_interval")
        b.find("growth_oscillation", "warning" if d.update_ratio > HEALTHY_UPDATE_RATIO else "problem",
               f"{len(after_growth)} of {later} overflows came on the step right after the scale grew: it "
               f"oscillates between {fmt_scale(min(seq[initial:]))} and {fmt_scale(max(seq[initial:]))}"
               + (f" (growth_interval {gi})" if gi is not None else ""), overflows_after_growth=len(after_growth))
        b.recommend("longer_growth_interval",
                    "Grow the scale less often: a longer growth_interval" + (f" than {gi}" if gi is not None else "")
                    + " (GradScaler's default is 2000), or hysteresis",
                    f"{len(after_growth)} overflows followed a growth step and cost {len(after_growth)} skipped "
                    f"updates", "growth_oscillation")
    elif len(spikes) >= 2:
        drop = spikes[0][1] / spikes[-1][2]
        sev = "warning" if len(spikes) >= 3 else "info"
        b.find("isolated_spikes", sev,
               f"{len(spikes)} isolated one-step overflows (steps "
               f"{', '.join(str(rows[i].step) for i, _, _ in spikes[:6])}"
               f"{', ...' if len(spikes) > 6 else ''}) each halved the scale, from {fmt_scale(spikes[0][1])} to "
               f"{fmt_scale(spikes[-1][2])} (2^{int(round(math.log2(drop)))} lower)", spikes=len(spikes),
               from_scale=spikes[0][1], to_scale=spikes[-1][2])
        if sev == "warning":
            if policy == "hysteresis":
                h = scaler_cfg.get("hysteresis", 2)
                b.recommend("hysteresis", f"Raise hysteresis above {h}, or refill it on every clean step "
                            "(DeepSpeed's consecutive_hysteresis)",
                            f"hysteresis {h} did not absorb {len(spikes)} isolated spikes: Megatron's tracker "
                            "refills only when the scale grows", "isolated_spikes")
            else:
                b.recommend("hysteresis", "Use hysteresis (policy: hysteresis, hysteresis: 2): the scale drops "
                            "only after repeated overflows",
                            f"{len(spikes)} isolated one-step overflows each halved the scale, "
                            f"{fmt_scale(spikes[0][1])} -> {fmt_scale(spikes[-1][2])}", "isolated_spikes")


def _census_findings(b: _Builder, d: Diagnosis, census: list[dict], precision) -> None:
    last = max(r["step"] for r in census)
    rows = [r for r in census if r["step"] == last]
    counterfactual = precision != "fp16"
    # source -> at_scale -> counts (the __total__ row, else the sum over layers)
    table: dict[str, dict[float, dict]] = {}
    for source in sorted({r["source"] for r in rows}):
        for at in sorted({r["at_scale"] for r in rows if r["source"] == source}):
            sel = [r for r in rows if r["source"] == source and r["at_scale"] == at]
            tot = [r for r in sel if r["layer"] == CENSUS_TOTAL]
            use = tot[:1] if tot else sel
            counts = {c: sum(r[c] for r in use) for c in CENSUS_COLUMNS[5:]}
            t = counts["total"] or 1
            counts.update(underflow_frac=counts["underflow"] / t, overflow_frac=counts["overflow"] / t,
                          subnormal_frac=counts["subnormal"] / t, zero_frac=counts["zero"] / t)
            table.setdefault(source, {})[at] = counts
    target = 1.0 if counterfactual or d.final_scale is None else d.final_scale
    if target is not None and not (target > 0 and math.isfinite(target)):
        target = 1.0

    def nearest(ats):
        return min(ats, key=lambda a: abs(math.log2(a) - math.log2(target)) if a > 0 else math.inf)

    at_final = {src: nearest(list(t)) for src, t in table.items()}
    d.underflow_at_final_scale = {src: table[src][at]["underflow_frac"] for src, at in at_final.items()}
    # layers: highest underflow fraction at the final scale, and overflow counts over every census step
    layer_uf: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["layer"] != CENSUS_TOTAL and r["at_scale"] == at_final.get(r["source"]) and r["total"]:
            f = r["underflow"] / r["total"]
            if f > layer_uf.get(r["layer"], (0.0, ""))[0]:
                layer_uf[r["layer"]] = (f, r["source"])
    uf_layers = sorted(((k, v) for k, v in layer_uf.items() if v[0] > 0), key=lambda kv: -kv[1][0])[:3]
    ovf_layers, ovf_from = Counter(), {}
    for r in census:
        if r["layer"] != CENSUS_TOTAL and r["overflow"]:
            ovf_layers[r["layer"]] += r["overflow"]
            ovf_from[r["layer"]] = min(ovf_from.get(r["layer"], math.inf), r["at_scale"])
    d.census = {"step": last, "counterfactual": counterfactual,
                "table": {src: {f"{at:g}": v for at, v in t.items()} for src, t in table.items()},
                "underflow_layers": {k: v[0] for k, v in uf_layers},
                "overflow_layers": dict(ovf_layers.most_common(3))}

    def describe(at):
        return ", ".join(f"{src.replace('_', ' ')}s {_pct(table[src][at]['underflow_frac'])}"
                         for src in table if at in table[src])

    worst_src = max(d.underflow_at_final_scale, key=d.underflow_at_final_scale.get)
    worst = d.underflow_at_final_scale[worst_src]
    at = at_final[worst_src]
    layer_txt = ("; most in " + ", ".join(f"{k} ({_pct(v[0])})" for k, v in uf_layers)) if uf_layers else ""
    # an FP32 (or bf16) run's census is counterfactual: advice for FP16, not a problem of this run
    sev = "warning" if worst >= UNDERFLOW_LARGE and not counterfactual else "info"
    if counterfactual:
        msg = (f"in FP16 at scale {fmt_scale(at)}, {describe(at)} of values would flush to zero (counterfactual "
               f"census of this {precision} run, step {last}){layer_txt}")
    else:
        zf = table[worst_src][at]["zero_frac"]
        msg = (f"at the final scale {fmt_scale(at)}, {describe(at)} of values flush to zero (census step {last})"
               f"{layer_txt}; {worst_src.replace('_', ' ')}s: {_pct(zf)} zero, flushed values included")
    b.find("underflow", sev, msg, underflow_at_final_scale=d.underflow_at_final_scale, at_scale=at,
           census_step=last, layers={k: v[0] for k, v in uf_layers})
    if ovf_layers:
        b.find("census_overflow_layers", "info", "values beyond FP16's range in the census: " + ", ".join(
               f"{k} ({v} values, from scale {fmt_scale(ovf_from[k])})" for k, v in ovf_layers.most_common(3)),
               layers=dict(ovf_layers.most_common(3)))

    all_ats = sorted({a for t in table.values() for a in t})
    if counterfactual and len(all_ats) > 1:
        fits = [a for a in all_ats if all(t[a]["overflow"] == 0 and t[a]["underflow_frac"] < UNDERFLOW_LARGE
                                          for t in table.values() if a in t)]
        # at every recorded scale some tensor class loses >= 1 % to underflow
        every = all(any(t[a]["underflow_frac"] >= UNDERFLOW_LARGE for t in table.values() if a in t)
                    for a in all_ats)
        per_scale = "; ".join(f"{fmt_scale(a)}: {describe(a)} under, "
                              f"{max(t[a]['overflow_frac'] for t in table.values() if a in t):.2%} over"
                              for a in all_ats)
        if every or not fits:
            b.find("no_fp16_scale_fits", "info", f"no recorded scale keeps FP16 underflow below "
                   f"{_pct(UNDERFLOW_LARGE)} without overflow ({per_scale})", per_scale=per_scale)
            b.recommend("bf16", "For reduced precision, train in bf16 rather than FP16 (FP32's range; no loss "
                        "scale needed)", f"counterfactual census at step {last}: {per_scale}", "no_fp16_scale_fits")
        elif worst >= UNDERFLOW_LARGE:
            best = fits[-1]
            b.recommend("raise_scale", f"For FP16 training: a loss scale near {fmt_scale_value(best)} (static) or "
                        "dynamic scaling, not scale 1",
                        f"at scale 1 {describe(at)} of values would flush to zero; at {fmt_scale(best)} "
                        f"{describe(best)} and nothing overflows", "underflow")
    elif not counterfactual and worst >= UNDERFLOW_LARGE:
        if d.overflow_steps == 0:
            b.recommend("raise_scale", "Raise the loss scale: dynamic scaling (fp16-dynamic) or a static scale "
                        f"above {fmt_scale(at)}",
                        f"{_pct(worst)} of {worst_src.replace('_', ' ')} values flushed to zero at scale "
                        f"{fmt_scale(at)} and no step overflowed, so there is headroom", "underflow")
        else:
            b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                        f"{_pct(worst)} of {worst_src.replace('_', ' ')} values underflow at scale {fmt_scale(at)} "
                        f"while {d.overflow_steps} steps overflowed: FP16's range is too narrow at both ends",
                        "underflow")

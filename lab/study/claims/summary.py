"""The default study's test kinds, on the aggregated summary's cells (summary.csv: one row per (model, mode)).

configs/claims.yaml's header documents them. Each predicate becomes two one-sided tests on the summary's cells
(lab/study/verdicts.py: Δ against FP32, its standard error and degrees of freedom from the pooled seed spread and the
examples): one whose rejection supports the claim, one whose rejection contradicts it; overflow claims use an exact
Poisson test on the in-training overflow counts with the steps as exposure; `all` combines its parts into one test.
Each kind is registered at the bottom (lab/study/claims/base.py's registry); lab/study/claims/ decides them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
from scipy import stats as st

from lab.core.config import STUDY_DEFAULTS
from lab.study import inference, stats
from lab.study.claims.base import (NOT_RESOLVED, OUT_OF_REACH, REACH, REGISTRY, Test, _optional, _OutOfReach, _row,
                                   _text, _Unresolved, _value, register, run_test)

#: metric -> (display scale, unit, digits, higher is better): top-1 is stored as a fraction, shown in pp
METRICS = {"top1": (100.0, "pp", 2, True), "val_loss": (1.0, "nats", 3, False)}
NAMES = {"top1": "top-1", "val_loss": "validation-loss"}
#: more_overflow columns, the default first: in-training overflow steps per 1000 steps (mean and sd over
#: seeds); the per-run counts overflow_steps / skipped_pct include the initial descent of the scale
COUNT_COLUMNS = ("overflow_per_1k", "overflow_steps", "skipped_pct")
#: share columns: per run, of the gradient values FP32 holds non-zero, the share FP16 keeps below its smallest
#: normal (flushed or subnormal) at the scale the census measured (mean and sd over seeds in the summary)
SHARE_COLUMNS = ("below_normal_adapter", "below_normal_activation")
DIRECTIONS = ("larger", "smaller")
#: used when summary.csv has no `confidence` column (older summaries)
DEFAULT_CONFIDENCE = float(STUDY_DEFAULTS["stats"]["confidence"])
DEFAULT_MARGINS = dict(STUDY_DEFAULTS["stats"]["margins"])


def _size_alpha(reach: dict) -> float:
    """The two-sided level seeds are sized at: Holm's first step over the claims' one-sided tests (set by evaluate;
    one claim on its own: 5%)."""
    return reach.get("size_alpha", 1 - DEFAULT_CONFIDENCE)


def _confidence(summary) -> float:
    """The summary's confidence level (column `confidence`; 0.95, the study default, when absent)."""
    if isinstance(summary, pd.DataFrame) and "confidence" in summary and summary["confidence"].notna().any():
        c = float(summary["confidence"].dropna().iloc[0])
        if 0 < c < 1:
            return c
    return DEFAULT_CONFIDENCE


def _margin(row: pd.Series | None, metric: str) -> float:
    """The declared equivalence margin for `metric` (column `<metric>_margin`; the study default when absent)."""
    m = _optional(row, f"{metric}_margin") if row is not None else math.nan
    return m if math.isfinite(m) and m > 0 else DEFAULT_MARGINS[metric]


@dataclass(frozen=True)
class Delta:
    """One row's Δ against FP32 on one metric, with what tests it."""
    label: str
    metric: str
    delta: float
    se: float
    df: float
    margin: float
    effect: float
    var_delta: float      # one seed's Δ variance (pooled 2σ², or the mode's own)
    df_seed: float
    v_example: float
    spread: str

    @property
    def cost_sign(self) -> float:
        """+1 when a larger Δ is a cost (loss), −1 when a smaller one is (top-1)."""
        return -1.0 if METRICS[self.metric][3] else 1.0

    def fmt(self, label: bool = True) -> str:
        scale, unit, digits, _ = METRICS[self.metric]
        hw = st.t.ppf(0.975, self.df) * self.se if self.se > 0 else 0.0
        text = f"{scale * self.delta:+.{digits}f} ± {scale * hw:.{digits}f} {unit}"
        if self.spread == "own":
            text += " (its own spread)"
        if self.spread == "identical":
            text = f"{scale * self.delta:+.{digits}f} {unit} (identical outcomes)"
        return f"{self.label} {self.metric} Δ {text}" if label else text

    def p_above(self, x: float) -> float:
        """p of H0: Δ ≤ x (small when Δ is shown above x)."""
        if self.se == 0:
            return 0.0 if self.delta > x else 1.0
        return float(st.t.sf((self.delta - x) / self.se, self.df))

    def p_below(self, x: float) -> float:
        """p of H0: Δ ≥ x (small when Δ is shown below x)."""
        if self.se == 0:
            return 0.0 if self.delta < x else 1.0
        return float(st.t.cdf((self.delta - x) / self.se, self.df))

    def seeds(self, effect: float, reach: dict) -> tuple:
        return inference.seeds_range(effect, self.var_delta, self.df_seed, self.v_example, _size_alpha(reach),
                                     reach["power"])


def _delta(summary: pd.DataFrame, model: str, mode: str, metric: str) -> Delta:
    row = _row(summary, model, mode)
    label = f"{model} {mode}"
    d = _value(row, f"{metric}_delta")
    if not math.isfinite(d):
        raise _Unresolved(f"{label}: no paired {metric} values against fp32")
    spread = _text(row, f"{metric}_spread") or "none"
    se, df = _optional(row, f"{metric}_se"), _optional(row, f"{metric}_df")
    if spread == "identical":
        se, df = 0.0, math.inf
    elif not (math.isfinite(se) and se > 0 and math.isfinite(df)):
        note = _text(row, f"{metric}_note") or "no spread"
        raise _OutOfReach(f"{label} {metric} Δ {METRICS[metric][0] * d:+.{METRICS[metric][2]}f} "
                          f"{METRICS[metric][1]}: {note}")
    n = _optional(row, f"{metric}_n_pairs")
    se_seed, se_ex = _optional(row, f"{metric}_se_seed"), _optional(row, f"{metric}_se_example")
    v_ex = se_ex ** 2 if math.isfinite(se_ex) else 0.0
    fixed = _optional(row, f"{metric}_se_example_fixed")
    v_fixed = min(fixed ** 2, v_ex) if math.isfinite(fixed) else v_ex
    margin = _margin(row, metric)
    effect = _optional(row, f"{metric}_effect")
    # for sizing: per seed, the seeds' variance plus the examples' part that more seeds average away
    per_seed = (se_seed ** 2 + v_ex - v_fixed) * n if math.isfinite(se_seed) else math.nan
    return Delta(label, metric, d, se, df, margin, effect if math.isfinite(effect) else margin,
                 per_seed, _optional(row, f"{metric}_df_seed"), v_fixed, spread)


def _fmt_metric(metric: str, signed: bool = False):
    scale, unit, digits, _ = METRICS[metric]
    return lambda v: f"{scale * v:{'+' if signed else ''}.{digits}f} {unit}"


# --- the predicate kinds ----------------------------------------------------------------------------------
def _bound(body: dict, tables: dict, reach: dict) -> Test:
    """Supported when Δ is shown on the claimed side of the bound, contradicted when shown on the other."""
    summary = tables["summary"]
    d = _delta(summary, body["model"], body["mode"], body["metric"])
    fmt = _fmt_metric(d.metric, True)
    if "at_least" in body:
        x, sign = body["at_least"], "≥"
        p_s, p_c = d.p_above(x), d.p_below(x)
    else:
        x, sign = body["at_most"], "≤"
        p_s, p_c = d.p_below(x), d.p_above(x)
    return Test(p_s, p_c, f"{d.fmt()}, claim Δ {sign} {fmt(x)}", d.seeds(abs(x), reach),
                f"telling Δ = 0 from the bound ({_fmt_metric(d.metric)(abs(x))})")


def _compare(body: dict, tables: dict, reach: dict) -> Test:
    """Left's Δ against right's (two families: independent): Welch's t on the difference. Supported when the
    difference is shown on the claimed side of 0; contradicted when it is shown short of the declared effect on that
    side (the claimed gain is smaller than the effect the claim is about, or goes the other way): the verdict follows
    the data in both directions, and a study with the power for the effect decides it either way."""
    summary = tables["summary"]
    m = body["metric"]
    a = _delta(summary, body["left"]["model"], body["left"]["mode"], m)
    b = _delta(summary, body["right"]["model"], body["right"]["mode"], m)
    diff, se = a.delta - b.delta, math.hypot(a.se, b.se)
    effect = max(a.effect, b.effect)
    sign = -1.0 if body["is"] == "smaller" else 1.0   # the claimed side
    if se == 0:
        p_s = 0.0 if sign * diff > 0 else 1.0
        p_c = 0.0 if sign * diff < effect else 1.0
    else:
        df = se ** 4 / ((a.se ** 4 / a.df if a.se else 0) + (b.se ** 4 / b.df if b.se else 0))
        p_s = float(st.t.sf(sign * diff / se, df))                 # H0: no difference on the claimed side
        p_c = float(st.t.cdf((sign * diff - effect) / se, df))     # H0: at least the effect on the claimed side
    fmt = _fmt_metric(m, True)
    ev = (f"{a.fmt()} vs {b.label} {b.fmt(label=False)}: difference {fmt(diff)}, claim: {body['is']} "
          f"(by the declared effect {_fmt_metric(m)(effect)})")
    # two rows: each Δ's variance adds; sized as one paired row of twice the variance at the declared effect
    seeds = inference.seeds_range(effect, a.var_delta + b.var_delta, min(a.df_seed, b.df_seed),
                                  a.v_example + b.v_example, _size_alpha(reach), reach["power"])
    return Test(p_s, p_c, ev, seeds, f"a difference of the declared effect ({_fmt_metric(m)(effect)})")


def _equivalent(body: dict, tables: dict, reach: dict) -> Test:
    """Supported by TOST within the declared margin; contradicted by a cost shown beyond the margin."""
    summary = tables["summary"]
    d = _delta(summary, body["model"], body["mode"], body["metric"])
    m, c = d.margin, d.cost_sign
    p_s = max(d.p_above(-m), d.p_below(m))
    p_c = d.p_above(m) if c > 0 else d.p_below(-m)
    return Test(p_s, p_c, f"{d.fmt()}, margin ±{_fmt_metric(d.metric)(m)}", d.seeds(m, reach),
                f"TOST at the declared margin ({_fmt_metric(d.metric)(m)})")


def _cost(body: dict, tables: dict, reach: dict) -> Test:
    """Supported by a cost shown above 0; contradicted by a cost shown below the declared margin (a gain, or a
    difference too small to matter)."""
    summary = tables["summary"]
    d = _delta(summary, body["model"], body["mode"], body["metric"])
    m, c = d.margin, d.cost_sign
    p_s = d.p_above(0.0) if c > 0 else d.p_below(0.0)
    p_c = d.p_below(m) if c > 0 else d.p_above(-m)
    return Test(p_s, p_c, f"{d.fmt()}, margin ±{_fmt_metric(d.metric)(m)}", d.seeds(d.effect, reach),
                f"a cost of the declared effect ({_fmt_metric(d.metric)(d.effect)})")


def _horizon(row: pd.Series, reach: dict) -> str:
    """'' when the row's overflow can be judged at this length, else why not."""
    grows = _text(row, "grows")
    label = f"{row['model']} {row['mode']}"
    if grows == "never":
        return ""
    interval, steps = _optional(row, "growth_interval"), _value(row, "steps_mean")
    if grows == "other" or (not grows and not math.isfinite(interval)):
        return (f"cannot judge: {label}'s policy grows its scale by a rule of its own, with no growth interval to "
                "set a horizon by" if grows == "other" else "")
    h = reach["horizon_intervals"]
    if steps >= h * interval:
        return ""
    return (f"{label}: runs are {steps:.0f} steps; {row['mode']} grows every {interval:.0f} steps: a horizon of "
            f"{h:g} growth intervals needs ≥ {h * interval:.0f} steps")


def _more_overflow(body: dict, tables: dict, reach: dict) -> Test:
    """In-training overflow steps over their exposure (steps after the first clean step), summed over seeds, once
    both rows span the horizon: an exact conditional Poisson test of the two rates."""
    summary = tables["summary"]
    column = body.get("column", COUNT_COLUMNS[0])
    if column != COUNT_COLUMNS[0]:
        raise _Unresolved(f"more_overflow.column {column}: per-run counts that include the initial descent have no "
                          "test; use overflow_per_1k")
    rows = [_row(summary, s["model"], s["mode"]) for s in (body["left"], body["right"])]
    short = [why for why in (_horizon(r, reach) for r in rows) if why]
    if short:
        raise _OutOfReach("; ".join(short))
    (ca, ea), (cb, eb) = ((_value(r, "overflow_count"), _value(r, "overflow_exposure")) for r in rows)
    if not all(math.isfinite(v) for v in (ca, ea, cb, eb)):
        raise _Unresolved("no in-training overflow counts (re-run aggregate)")
    res = inference.poisson_compare(ca, ea, cb, eb)
    la, lb = (f"{r['model']} {r['mode']}" for r in rows)
    ev = (f"{la} {ca:g} in-training overflow steps in {ea:g} steps ({res['rate1']:.2f} per 1000) vs {lb} {cb:g} in "
          f"{eb:g} ({res['rate2']:.2f}); exact Poisson test, claim: first > second")
    if "ratio" not in body:
        return Test(res["p_larger"], res["p_smaller"], ev)
    return Test(res["p_larger"], res["p_smaller"], ev, *_overflow_seeds(body["ratio"], cb, eb, rows[1], lb, reach))


def _overflow_seeds(ratio: float, count: float, exposure: float, right: pd.Series, label: str, reach: dict):
    """Seeds per row that show the declared rate ratio over the right row's rate (at its measured rate, and at the
    lower bound of its one-sided 90% interval), as long as the runs are now: (seeds range, what they are for)."""
    n = _optional(right, "n_seeds")
    per_seed = exposure / n if n > 0 else math.nan  # NaN (an older summary): no sizing
    level = _size_alpha(reach) / 2  # one-sided, at Holm's first step
    low = stats.poisson_rate_interval(count, exposure, 0.8)[0]
    seeds = tuple(inference.poisson_seeds_for(rate, ratio, per_seed, level, reach["power"])
                  for rate in (count / exposure, low))
    return seeds, (f"a rate {ratio:g}x {label}'s ({1000 * count / exposure:.2f} per 1000 steps; runs of "
                   f"{per_seed:.0f} steps)")


def _share(body: dict, tables: dict, reach: dict) -> Test:
    """A share measured per run (e.g. the adapters' gradient values FP16 keeps below its smallest normal) against a
    bound: a one-sample t over the seeds (each run is one independent draw), n - 1 degrees of freedom; a spread of
    zero decides nothing."""
    summary = tables["summary"]
    row = _row(summary, body["model"], body["mode"])
    column = body["column"]
    mean, sd, n = _value(row, column), _value(row, f"{column}_sd"), _value(row, "n_seeds")
    if n < 2 or not math.isfinite(sd):
        raise _Unresolved(f"{body['model']} {body['mode']} {column}: one seed gives no spread to decide on")
    if sd == 0:
        raise _OutOfReach(f"{body['model']} {body['mode']} {column}: every seed gives {mean:.4f}: a spread of zero "
                          "decides nothing")
    x, sign = (body["at_least"], "≥") if "at_least" in body else (body["at_most"], "≤")
    t = (mean - x) / (sd / math.sqrt(n))
    above, below = float(st.t.sf(t, n - 1)), float(st.t.sf(-t, n - 1))
    p_s, p_c = (above, below) if "at_least" in body else (below, above)
    ev = (f"{body['model']} {body['mode']} {column.replace('_', ' ')} {100 * mean:.3g}% (sd {100 * sd:.2g} pp over "
          f"{n:.0f} seeds), claim {sign} {100 * x:g}%; one-sample t on {n - 1:.0f} df")
    return Test(p_s, p_c, ev)


def _all(body: list, tables: dict, reach: dict) -> Test:
    """Supported when every part is (intersection–union: the largest support p); contradicted when any part is
    (Bonferroni over the parts: the smallest contradiction p times their number)."""
    parts = [run_test(*next(iter(item.items())), tables, reach) for item in body]
    p_s = max(p.p_support for p in parts) if all(math.isfinite(p.p_support) for p in parts) else math.nan
    pcs = [p.p_contradict for p in parts if math.isfinite(p.p_contradict)]
    p_c = min(1.0, len(parts) * min(pcs)) if pcs else math.nan
    evidence = "; ".join(p.evidence or p.blocked for p in parts)
    blocked = [p for p in parts if p.blocked]
    sized = [p for p in parts if p.seeds_what and not p.blocked]
    seeds = (max((p.seeds[0] for p in sized), default=math.nan), max((p.seeds[1] for p in sized), default=math.nan))
    t = Test(p_s, p_c, evidence, seeds, "the slowest part" if sized else "", parts=parts)
    if blocked:
        t.blocked = "a part cannot be decided here"
        t.blocked_kind = OUT_OF_REACH if any(p.blocked_kind == OUT_OF_REACH for p in blocked) else NOT_RESOLVED
    return t

# --- what each claim needs to be decided -------------------------------------------------------------------
def needs(kind: str, body, summary: pd.DataFrame | None = None, reach: dict | None = None) -> str:
    """The metric and the smallest difference a claim is about, in words (e.g. 'top-1 Δ ≥ -0.30 pp, paired
    over seeds'); the equivalence margin is the summary's (`<metric>_margin`) or the study default."""
    reach = {**REACH, **(reach or {})}
    if kind == "all":  # each part prefixed with its row where it has one
        parts = (next(iter(item.items())) for item in body)
        return "; ".join((f"{b['model']} {b['mode']}: " if {"model", "mode"} <= set(b) else "")
                         + REGISTRY[("summary", k)].needs(k, b, summary, reach) for k, b in parts)
    if kind == "more_overflow":
        column = body.get("column", COUNT_COLUMNS[0])
        if column == COUNT_COLUMNS[0]:
            effect = f", declared effect a {body['ratio']:g}x rate" if "ratio" in body else ""
            return (f"in-training overflow steps over their exposure, horizon ≥ {reach['horizon_intervals']:g} "
                    f"growth intervals, exact Poisson test{effect}")
        return f"{column} per run: no test (counts the initial descent too)"
    if kind == "share":
        sign = "≥" if "at_least" in body else "≤"
        return (f"{body['column'].replace('_', ' ')} {sign} {100 * body.get('at_least', body.get('at_most')):g}% "
                "per run, one-sample t over seeds")
    metric = body["metric"]
    scale, unit, digits, _ = METRICS[metric]
    name = NAMES[metric]
    if kind == "bound":
        limit = "at_least" if "at_least" in body else "at_most"
        sign = "≥" if limit == "at_least" else "≤"
        return f"{name} Δ {sign} {scale * body[limit]:+.{digits}f} {unit}, same seeds and examples"
    if kind == "compare":
        left, right = (f"{body[s]['model']} {body[s]['mode']}" for s in ("left", "right"))
        sign = "<" if body["is"] == "smaller" else ">"
        return f"{name} Δ of {left} {sign} Δ of {right}, Welch t on the difference"
    if kind == "cost":
        return f"{name} cost > 0 {unit}, same seeds and examples"
    row = None
    if summary is not None:
        try:
            row = _row(summary, body["model"], body["mode"])
        except _Unresolved:
            pass
    return f"{name} equivalence within ±{scale * _margin(row, metric):.{digits}f} {unit} (TOST, declared margin)"


# --- the registry: kind, table, required keys, optional keys ----------------------------------------------
register("bound", "summary", {"model", "mode", "metric"}, {"at_least", "at_most"}, needs=needs)(_bound)
register("compare", "summary", {"metric", "left", "is", "right"}, needs=needs)(_compare)
register("equivalent", "summary", {"model", "mode", "metric"}, needs=needs)(_equivalent)
register("cost", "summary", {"model", "mode", "metric"}, needs=needs)(_cost)
register("more_overflow", "summary", {"left", "right"}, {"column", "ratio"}, needs=needs)(_more_overflow)
register("share", "summary", {"model", "mode", "column"}, {"at_least", "at_most"}, needs=needs)(_share)
register("all", "summary", needs=needs)(_all)  # a list of predicates instead of keys

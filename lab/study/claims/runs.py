"""Test kinds on a per-run table (one row per run: `mode`, `seed` and its measurements; the RL study's runs.csv from
lab/rl/grpo_aggregate.py, every other study's from lab/study/runs_table.py) and a per-unit `shape` table beside it (lab/rl/shape.py). The unit is the run: its seed, paired
across modes (the same seed draws the same problems), or for the shape table a random model's seed.

Each kind is one-sided: its support p-value joins the claims file's Holm family (lab/study/claims/); a test that
cannot be computed counts there as p = 1; its contradiction is a bound at Holm's first (strictest) level,
``reach["level"]``, which sizing uses too:

* ``compare: {column, left, is: smaller|larger, right, effect, horizon}``: the paired (same seed) difference left -
  right, one-sided Student t. Contradicted when it is not shown and the one-sided bound excludes the declared
  ``effect`` in the claimed direction; else the paired seeds that effect needs at the measured spread (out of reach
  beyond ``max_seeds``). A difference shown but smaller than declared is supported, and its estimate says so.
  ``horizon: true``: a claim about how a scale rule grows: out of reach while either mode's runs are shorter than
  ``horizon_intervals`` of its growth interval (before its first growth two rules that differ only there are the
  same rule), as the summary's overflow claims are.
* ``bound: {column, mode, at_most | at_least, log}``: one mode's per-run value against a bound, a one-sample t over
  the seeds (``log: true``: on log10 of the values, for magnitudes that spread by factors); contradicted when the
  one-sided bound at the level lies wholly on the other side of it.
* ``equivalent: {column, left, right, margin}``: TOST on the paired difference (the larger of the two one-sided
  p-values); contradicted when the whole (1 - 2 level) interval lies outside +-margin.
* ``no_more: {column, left, right, margin}``: non-inferiority, left - right < margin (TOST's upper one-sided test);
  contradicted when the one-sided lower bound lies above the margin.
* ``order: {column, modes: [a, b, c]}``: a < b < ... within each seed, each adjacent pair an exact sign test (ties
  count against the claim).
* ``greater_within: {table: runs|shape, modes, larger, smaller}``: column ``larger`` > ``smaller`` within each unit
  (each run of ``modes``; each shape unit), an exact sign test.
* ``ratio_within: {column, numerator, denominator, low, high}``: the per-seed log ratio; supported when its
  (1 - 2 level) t-interval lies inside [log low, log high] (TOST), contradicted when wholly outside.
* ``fewer_skips: {left, right}``: per-seed skipped steps, left - right paired, one-sided t; with no skip in either
  mode the claim is out of reach (the scale never met the overflow point in the runs' length).
* ``each_run: {column, mode, at_least | at_most}``: a count each run of ``mode`` measures exactly (the ranks'
  disagreements of configs/fsdp-unscale.yaml), against a bound: the runs meeting it, an exact sign test against 1/2
  (each seed a draw of the data), supported when that many are shown; contradicted when the runs missing it are shown
  (their sign test at the level). n runs all on one side give 2^-n: the kind says how many runs that takes.
* ``trend: {column, mode, models: [a, b, ...], is: increasing|decreasing, effect}``: across families that differ in
  one setting by equal steps (configs/long-context.yaml: the context doubling from one to the next), each seed's
  least-squares slope of log2(column) against the family's place in the list (``log: false``: of the column
  itself), one-sided Student t over the seeds that trained every family. Contradicted when it is not shown and the
  one-sided bound excludes the declared ``effect`` (per step) in the claimed direction; else the seeds that effect
  needs at the measured spread.
* ``differs: {columns: [a, ...], left, right}``: left's values differ from right's on the same seed. Contradicted
  by construction when every column is equal, bit for bit as the table holds it, on every seed (at least two):
  the two modes computed the same numbers (configs/long-context.yaml: training with and without gradient
  checkpointing), and no number of seeds finds a difference that is not there; else the paired difference of the
  first column, a two-sided Student t (its p-value the support's).

A zero-width interval decides nothing: such a test is not resolved (or out of reach), never supported.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as st

from lab.study.claims.base import ClaimsError, Test, _Unresolved, register
from lab.study.inference import seeds_for

#: how a column's differences are shown: (factor, unit); the census's shares (metrics.json, a fraction) in pp
UNITS = {"solved_end": (100.0, " pp"), "accuracy_end": (100.0, " pp"),   # accuracy_end: the DPO family's (rl-long)
         **{f"{what}_{source}": (100.0, " pp") for what in ("flushed", "subnormal")
            for source in ("activation", "param", "adapter")}}


def _runs(spec: dict, tables: dict) -> pd.DataFrame:
    """The runs table, or one family's rows of it (`model:`, for a study of several families: configs/fp8.yaml)."""
    runs = tables["runs"]
    if "model" not in spec:
        return runs
    if "model" not in runs or spec["model"] not in set(runs["model"]):
        raise _Unresolved(f"model {spec['model']!r} has no runs in the table")
    return runs[runs["model"] == spec["model"]]


def _by_seed(runs: pd.DataFrame, mode: str, column: str) -> pd.Series:
    rows = runs[runs["mode"] == mode]
    if rows.empty:
        # as the summary's kinds do: a mode the study did not train leaves the claim undecided, with the reason
        raise _Unresolved(f"mode {mode!r} has no runs in the table (modes: {', '.join(runs['mode'].unique())})")
    if column not in rows:
        raise ClaimsError(f"column {column!r} is not in the runs table")
    return rows.set_index("seed")[column].astype(float)


def _paired(runs, column, left, right) -> np.ndarray:
    a, b = _by_seed(runs, left, column), _by_seed(runs, right, column)
    common = sorted(set(a.index) & set(b.index))
    return (a[common] - b[common]).to_numpy()


def _shown(column: str, value: float) -> str:
    factor, unit = UNITS.get(column, (1.0, ""))
    return f"{factor * value:+.3g}{unit}"


def _t_one_sided(d: np.ndarray, larger: bool) -> tuple[float, float, float]:
    """(mean, se, one-sided p of mean > 0 if ``larger`` else mean < 0); p nan when the spread is zero."""
    n, mean = len(d), float(np.mean(d))
    se = float(np.std(d, ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    if not (se > 0):
        return mean, se, math.nan
    t = mean / se
    return mean, se, float(st.t.sf(t, n - 1) if larger else st.t.cdf(t, n - 1))


def _sign(wins: int, n: int) -> float:
    """Exact one-sided sign test: P(X >= wins), X ~ Binomial(n, 1/2)."""
    return float(st.binom.sf(wins - 1, n, 0.5)) if n else math.nan


def _test(what: str, p: float = math.nan, estimate: str = "", contradicted: bool = False) -> Test:
    return Test(p, math.nan, estimate, one_sided=True, contradicted=contradicted, what=what)


def _sizing(effect: float, var: float, reach: dict, equivalence: bool = False) -> str:
    """Paired seeds a declared effect (or margin) of this size needs at the measured spread."""
    # seeds_for sizes a two-sided test at its alpha: 2 * level is the one-sided level here; TOST at a true
    # difference of 0 needs each one-sided test to pass at power (1 + power) / 2, approximately
    power = (1 + reach["power"]) / 2 if equivalence else reach["power"]
    if not reach.get("sizing", True):  # the calibration simulation: verdicts only
        return ""
    n = seeds_for(effect, var, 0.0, 2 * reach["level"], power, cap=reach["max_seeds"])
    if not math.isfinite(n) or n > reach["max_seeds"]:
        return f"more than {reach['max_seeds']} paired seeds at the measured spread"
    return f"about {n:g} paired seeds at the measured spread"


def compare(spec: dict, tables: dict, reach: dict) -> Test:
    """Paired one-sided t on left - right; contradicted when the bound at the level excludes the declared effect."""
    larger = spec["is"] == "larger"
    d = _paired(_runs(spec, tables), spec["column"], spec["left"], spec["right"])
    mean, se, p = _t_one_sided(d, larger)
    test = _test(f"{spec['left']} {spec['is']} than {spec['right']} ({spec['column']})", p,
                 f"Δ {_shown(spec['column'], mean)} (se {_shown(spec['column'], se)[1:]}, {len(d)} seeds)")
    short = _short_of_horizon(_runs(spec, tables), (spec["left"], spec["right"]), reach) if spec.get("horizon") else ""
    if short:
        test.p_support, test.blocked = math.nan, short[0]
        test.needs = short[1]
        return test
    effect = abs(float(spec["effect"]))
    if not math.isfinite(p):
        test.blocked = "the paired differences have zero spread"
        return test
    # the one-sided bound on the side the claim needs: it rules out the declared effect when it stops short of it
    bound = st.t.ppf(1 - reach["level"], len(d) - 1) * se
    test.excludes_effect = bool((mean + bound < effect) if larger else (mean - bound > -effect))
    test.needs = _sizing(effect, float(np.var(d, ddof=1)), reach)
    return test


def _short_of_horizon(runs: pd.DataFrame, modes, reach: dict) -> tuple[str, str] | tuple[()]:
    """(why, what would decide it) when a mode's runs are shorter than ``horizon_intervals`` of its growth interval
    (metrics.json ``growth_interval``; a mode without one never grows by an interval), else ()."""
    h, why, longest = reach["horizon_intervals"], [], 0
    for mode in modes:
        steps = _by_seed(runs, mode, "steps").min()
        interval = _by_seed(runs, mode, "growth_interval").max() if "growth_interval" in runs else math.nan
        if math.isfinite(interval) and steps < h * interval:
            why.append(f"{mode}'s runs are {steps:.0f} steps and its scale grows every {interval:.0f}")
            longest = max(longest, h * interval)
    if not why:
        return ()
    return (f"{'; '.join(why)}: no growth can happen in them, so the rules cannot differ there",
            f"runs of at least {longest:.0f} steps ({h:g} growth intervals)")


def bound(spec: dict, tables: dict, reach: dict) -> Test:
    """One mode's per-run value against a bound: one-sample t over the seeds (log10 of the values with ``log``)."""
    at_most = "at_most" in spec
    x = float(spec["at_most"] if at_most else spec["at_least"])
    v = _by_seed(_runs(spec, tables), spec["mode"], spec["column"]).dropna().to_numpy()
    log = bool(spec.get("log", False))
    if log and (x <= 0 or (v <= 0).any()):
        raise ClaimsError(f"bound.log: {spec['column']} and the bound must be positive to take logs")
    d = (np.log10(v) - math.log10(x)) if log else v - x
    mean, se, p = _t_one_sided(d, not at_most)
    centre = (f"geometric mean {10 ** (mean + math.log10(x)):.3g}" if log
              else f"mean {_shown(spec['column'], mean + x)[1:]}")
    test = _test(f"{spec['mode']} {spec['column']} {'≤' if at_most else '≥'} {x:g}", p,
                 f"{centre} over {len(d)} seeds" + (", on log10" if log else ""))
    if not math.isfinite(p):
        test.blocked = "every seed gives the same value: a spread of zero decides nothing"
        return test
    half = st.t.ppf(1 - reach["level"], len(d) - 1) * se
    lo, hi = mean - half, mean + half
    shown = (lambda u: f"{10 ** (u + math.log10(x)):.3g}") if log else (lambda u: _shown(spec["column"], u + x)[1:])
    test.evidence += f" (its {100 * (1 - 2 * reach['level']):.1f}% interval [{shown(lo)}, {shown(hi)}])"
    test.contradicted = bool(lo > 0) if at_most else bool(hi < 0)
    return test


def _against_margin(spec: dict, tables: dict, what: str):
    """(test, paired differences, margin, mean, se) for a test of left - right against the declared margin; the
    test already blocked (and the rest None) when the differences have no spread."""
    d = _paired(_runs(spec, tables), spec["column"], spec["left"], spec["right"])
    m = float(spec["margin"])
    mean, se, _ = _t_one_sided(d, True)
    test = _test(f"{spec['left']} {what.format(m=m, right=spec['right'])} ({spec['column']})",
                 estimate=f"Δ {_shown(spec['column'], mean)} (se {_shown(spec['column'], se)[1:]}, {len(d)} seeds)")
    if not (se > 0):
        test.blocked = ("the runs are identical on every seed (Δ exactly 0): no spread to test against"
                        if not np.any(d) else "the paired differences have zero spread")
        return test, None, None, None, None
    return test, d, m, mean, se


def equivalent(spec: dict, tables: dict, reach: dict) -> Test:
    """TOST on the paired difference against +-margin."""
    test, d, m, mean, se = _against_margin(spec, tables, "within ±{m:g} of {right}")
    if d is None:
        return test
    df = len(d) - 1
    test.p_support = float(max(st.t.sf((mean + m) / se, df), st.t.cdf((mean - m) / se, df)))
    half = st.t.ppf(1 - reach["level"], df) * se
    test.contradicted = bool(mean - half > m or mean + half < -m)
    test.needs = _sizing(m, float(np.var(d, ddof=1)), reach, equivalence=True)
    return test


def no_more(spec: dict, tables: dict, reach: dict) -> Test:
    """Non-inferiority: left - right < margin, paired one-sided t (TOST's upper half); contradicted when the
    one-sided lower bound at the level lies above the margin."""
    test, d, m, mean, se = _against_margin(spec, tables, "no more than {right} + {m:g}")
    if d is None:
        return test
    df = len(d) - 1
    test.p_support = float(st.t.cdf((mean - m) / se, df))
    test.contradicted = bool(mean - st.t.ppf(1 - reach["level"], df) * se > m)
    test.needs = _sizing(m, float(np.var(d, ddof=1)), reach)
    return test


def order(spec: dict, tables: dict, reach: dict) -> Test:
    """Each adjacent pair of modes an exact sign test within seeds."""
    modes, steps, ps = spec["modes"], [], []
    for lo, hi in zip(modes, modes[1:]):
        d = _paired(_runs(spec, tables), spec["column"], hi, lo)
        wins, losses = int((d > 0).sum()), int((d < 0).sum())
        ps.append(_sign(wins, len(d)))
        steps.append(f"{lo} < {hi} in {wins} of {len(d)} seeds")
        if _sign(losses, len(d)) <= reach["level"]:
            return _test(" < ".join(modes), max(ps), "; ".join(steps), contradicted=True)
    return _test(" < ".join(modes) + f" ({spec['column']})", max(ps), "; ".join(steps))


def greater_within(spec: dict, tables: dict, reach: dict) -> Test:
    """Column ``larger`` > ``smaller`` within each unit, an exact sign test."""
    table = tables.get(spec["table"])
    if table is None:
        raise ClaimsError(f"greater_within needs the {spec['table']} table (lab rl-shape)")
    rows = table[table["mode"].isin(spec["modes"])] if spec.get("modes") else table
    d = (rows[spec["larger"]].astype(float) - rows[spec["smaller"]].astype(float)).dropna().to_numpy()
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    ratio = float(np.median(rows[spec["larger"]] / rows[spec["smaller"]]))
    return _test(f"{spec['larger']} > {spec['smaller']} within each unit", _sign(wins, len(d)),
                 f"in {wins} of {len(d)} units (median ratio {ratio:.3g})",
                 contradicted=_sign(losses, len(d)) <= reach["level"])


def ratio_within(spec: dict, tables: dict, reach: dict) -> Test:
    """The per-seed log ratio's interval inside [log low, log high] (TOST)."""
    runs = _runs(spec, tables)
    a, b = _by_seed(runs, spec["numerator"], spec["column"]), _by_seed(runs, spec["denominator"], spec["column"])
    common = sorted(set(a.index) & set(b.index))
    r = np.log(a[common].to_numpy() / b[common].to_numpy())
    mean, se, _ = _t_one_sided(r, True)
    lo, hi = math.log(spec["low"]), math.log(spec["high"])
    test = _test(f"{spec['numerator']} / {spec['denominator']} within [{spec['low']:g}, {spec['high']:g}] "
                 f"({spec['column']})", estimate=f"geometric mean ratio {math.exp(mean):.3g} ({len(r)} seeds)")
    if not (se > 0):
        test.blocked = "the log ratios have zero spread"
        return test
    df = len(r) - 1
    test.p_support = float(max(st.t.sf((mean - lo) / se, df), st.t.cdf((mean - hi) / se, df)))
    half = st.t.ppf(1 - reach["level"], df) * se
    test.evidence += (f", its {100 * (1 - 2 * reach['level']):.1f}% interval [{math.exp(mean - half):.3g}, "
                      f"{math.exp(mean + half):.3g}]")
    test.contradicted = bool(mean - half > hi or mean + half < lo)
    return test


def fewer_skips(spec: dict, tables: dict, reach: dict) -> Test:
    """Per-seed skipped steps, left - right paired, one-sided t."""
    runs = _runs(spec, tables)
    d = _paired(runs, "skipped_steps", spec["left"], spec["right"])
    left, right = _by_seed(runs, spec["left"], "skipped_steps"), _by_seed(runs, spec["right"], "skipped_steps")
    steps = int(_by_seed(runs, spec["left"], "steps").iloc[0])
    mean, se, p = _t_one_sided(d, False)
    test = _test(f"{spec['left']} skips fewer steps than {spec['right']}", p,
                 f"skipped per run {left.mean():.2f} vs {right.mean():.2f} ({len(d)} seeds of {steps} steps)")
    if left.sum() == 0 and right.sum() == 0:
        test.blocked = f"no step was skipped under either in {steps} steps"
        test.needs = "runs long enough for the scale to reach its overflow point under both rules"
    elif not (se > 0):
        test.blocked = f"every seed's difference is the same ({d[0]:+g} skips): an interval of zero width"
        test.needs = "more seeds or longer runs, where the counts vary from seed to seed"
    else:
        test.contradicted = bool(st.t.sf(mean / se, len(d) - 1) <= reach["level"])
        # shown only where the test is not decided: seeds are sized from a declared effect, never the observed one
        test.needs = ("seeds sized from a declared difference in skips per run, which this claim does not declare"
                      + (f"; here the other way, {left.mean():.2f} vs {right.mean():.2f} a run" if mean >= 0 else ""))
    return test


def each_run(spec: dict, tables: dict, reach: dict) -> Test:
    """The runs of one mode meeting a bound on a per-run count, an exact sign test each way."""
    limits = [k for k in ("at_least", "at_most") if k in spec]  # one, a number: checked with the file (file.py)
    bound = float(spec[limits[0]])
    values = _by_seed(_runs(spec, tables), spec["mode"], spec["column"])
    meets = values >= bound if limits[0] == "at_least" else values <= bound  # a NaN (no measurement) misses it
    n, k = len(values), int(meets.sum())
    shown = ", ".join(f"{v:g}" for v in values.to_numpy())
    test = _test(f"{spec['column']} {'≥' if limits[0] == 'at_least' else '≤'} {bound:g} in each run of {spec['mode']}",
                 _sign(k, n), f"in {k} of {n} runs ({shown})", contradicted=_sign(n - k, n) <= reach["level"])
    fewest = math.ceil(math.log2(1 / reach["level"]))  # runs all on one side that a sign test needs at the level
    if n < fewest and not test.contradicted:
        test.needs = f"at least {fewest} runs all meeting the bound (or all missing it), {n} in hand"
    elif 0 < k < n:
        test.needs = f"more runs: {k} of {n} meet the bound, {n - k} miss it"
    return test


def _slopes(spec: dict, runs: pd.DataFrame) -> np.ndarray:
    """Each seed's least-squares slope of log2(column) (or the column) against the family's place in ``models``,
    over the seeds every family trained in ``mode``."""
    per = [_by_seed(runs[runs["model"] == m], spec["mode"], spec["column"]) for m in spec["models"]]
    seeds = sorted(set.intersection(*(set(p.index) for p in per)))
    y = np.array([[p[s] for p in per] for s in seeds], float)  # (seeds, models)
    if spec.get("log", True):
        if not np.all(y > 0):
            raise _Unresolved(f"{spec['column']}: a value that is not positive has no logarithm (log: false)")
        y = np.log2(y)
    x = np.arange(len(spec["models"]), dtype=float)
    x -= x.mean()
    return (y - y.mean(1, keepdims=True)) @ x / (x @ x)


def trend(spec: dict, tables: dict, reach: dict) -> Test:
    """Per-seed slope across the families, one-sided t; contradicted when the bound excludes the declared effect."""
    if not isinstance(spec["models"], list) or len(spec["models"]) < 2:
        raise ClaimsError("trend: models needs a list of at least two families")
    if spec["is"] not in ("increasing", "decreasing"):
        raise ClaimsError(f"trend.is: {spec['is']!r} is not allowed; allowed: increasing, decreasing")
    increasing = spec["is"] == "increasing"
    runs = tables["runs"]
    if "model" not in runs or not set(spec["models"]) <= set(runs["model"]):
        raise _Unresolved(f"trend: families {sorted(set(spec['models']) - set(runs.get('model', [])))} have no runs")
    d = _slopes(spec, runs)
    mean, se, p = _t_one_sided(d, increasing)
    unit = "log2 " if spec.get("log", True) else ""
    test = _test(f"{spec['column']} {spec['is']} across {', '.join(spec['models'])} ({spec['mode']})", p,
                 f"slope {mean:+.3g} {unit}per step (se {se:.2g}, {len(d)} seeds)")
    effect = abs(float(spec["effect"]))
    if not math.isfinite(p):
        test.blocked = "the slopes have zero spread" if len(d) >= 2 else "fewer than two seeds trained every family"
        return test
    bound = st.t.ppf(1 - reach["level"], len(d) - 1) * se
    test.excludes_effect = bool((mean + bound < effect) if increasing else (mean - bound > -effect))
    test.needs = _sizing(effect, float(np.var(d, ddof=1)), reach)
    return test


def differs(spec: dict, tables: dict, reach: dict) -> Test:
    """Left differs from right on the same seed: contradicted when equal in every column on every seed."""
    runs, columns = _runs(spec, tables), list(spec["columns"])
    pairs = [(_by_seed(runs, spec["left"], c), _by_seed(runs, spec["right"], c)) for c in columns]
    seeds = sorted(set(pairs[0][0].index) & set(pairs[0][1].index))
    same = all(np.array_equal(a[seeds].to_numpy(), b[seeds].to_numpy(), equal_nan=True) for a, b in pairs)
    what = f"{spec['left']} differs from {spec['right']} ({', '.join(columns)})"
    if same and len(seeds) >= 2:
        return _test(what, estimate=f"identical bit for bit in all {len(columns)} columns on all {len(seeds)} seeds "
                                    "(Δ exactly 0): the same computation", contradicted=True)
    d = (pairs[0][0][seeds] - pairs[0][1][seeds]).to_numpy()
    mean, se, p = _t_one_sided(d, True)
    test = _test(what, estimate=f"Δ {_shown(columns[0], mean)} (se {_shown(columns[0], se)[1:]}, {len(d)} seeds)")
    if not (se > 0):
        test.blocked = "the paired differences have zero spread"
        return test
    test.p_support = float(2 * min(p, 1 - p))
    return test


# --- the registry: kind, table, required keys, optional keys ----------------------------------------------
# every kind takes `model:` (one family's rows) where the table holds several
register("compare", "runs", {"column", "left", "is", "right", "effect"}, {"model", "horizon"},
         family="one-sided")(compare)
register("bound", "runs", {"column", "mode"}, {"at_most", "at_least", "log", "model"}, family="one-sided")(bound)
register("equivalent", "runs", {"column", "left", "right", "margin"}, {"model"}, family="one-sided")(equivalent)
register("no_more", "runs", {"column", "left", "right", "margin"}, {"model"}, family="one-sided")(no_more)
register("order", "runs", {"column", "modes"}, {"model"}, family="one-sided")(order)
register("greater_within", "runs", {"table", "larger", "smaller"}, {"modes", "model"},
         family="one-sided")(greater_within)
register("ratio_within", "runs", {"column", "numerator", "denominator", "low", "high"}, {"model"},
         family="one-sided")(ratio_within)
register("fewer_skips", "runs", {"left", "right"}, {"model"}, family="one-sided")(fewer_skips)
register("each_run", "runs", {"column", "mode"}, {"at_least", "at_most", "model"}, family="one-sided")(each_run)
register("trend", "runs", {"column", "mode", "models", "is", "effect"}, {"log"}, family="one-sided")(trend)
register("differs", "runs", {"columns", "left", "right"}, {"model"}, family="one-sided")(differs)

"""A claim about a detector of runs (the source's alert thresholds; configs/claims_alerts.yaml): "the
detector that fires when `column` lies in a range flags runs that end worse with precision (or catches them with
recall) at least / at most X", on a per-run table with an outcome column `worse` (1 / 0; empty: not judged, e.g. no
FP32 twin) and a `cluster` column (the runs that are not independent of each other: one study's seed, whose modes
share the FP32 reference, the initial weights and the data order).

    detects: {column, fires: {at_least | at_most | above | below: v, ...}, precision_at_least | precision_at_most |
              recall_at_least | recall_at_most: X, among: a 0/1 column (its rows with 1 only), model}

The unit is the cluster. Precision's units are the clusters holding a run the detector fires on, recall's the clusters
holding a run that ends worse; each unit is one Bernoulli trial, its runs collapsed the conservative way for each
side: for support of "at least X" a cluster is a hit only when every relevant run in it is one (for "at most X", when
any is), for contradiction the other way. For any dependence within a cluster, P(all hit) <= the cluster-weighted
rate (each cluster's relevant runs weighted equally) <= P(any hits), so both exact one-sided binomial tests keep their
level for that rate; where each cluster holds one relevant run it is the run-level rate and the collapses coincide.

One-sided, as the other per-run kinds (lab/study/claims/runs.py): the support p-value joins the file's Holm family;
contradicted when the exact one-sided bound at Holm's first level, ``reach["level"]``, lies on the other side of X.
A detector that fires on no run (for recall: no run ends worse) is out of reach here, with what would decide it: the
fewest clusters, all on the claimed side, whose exact test reaches that level.
"""
from __future__ import annotations

import math

import pandas as pd
from scipy import stats as st

from lab.study.claims.base import ClaimsError, Test, _Unresolved, register

BOUNDS = ("precision_at_least", "precision_at_most", "recall_at_least", "recall_at_most")
RANGE_KEYS = ("at_least", "at_most", "above", "below")
OUTCOME, CLUSTER = "worse", "cluster"


def fires(values: pd.Series, spec: dict) -> pd.Series:
    """Where the detector fires: every bound of ``spec`` (at_least, at_most: inclusive; above, below: strict) holds.
    A missing value never fires."""
    v = pd.to_numeric(values, errors="coerce")
    out = v.notna()
    for key, bound in spec.items():
        out &= {"at_least": v >= bound, "at_most": v <= bound, "above": v > bound, "below": v < bound}[key]
    return out


def describe(column: str, spec: dict) -> str:
    """The range in words, e.g. 'longest_skip_streak >= 3'."""
    sign = {"at_least": ">=", "at_most": "<=", "above": ">", "below": "<"}
    return " and ".join(f"{column} {sign[k]} {v:g}" for k, v in spec.items())


def _check(spec: dict, runs: pd.DataFrame) -> tuple[str, float]:
    """(bound key, X) of a claim, its range and columns checked (ClaimsError naming what is wrong)."""
    bounds = [k for k in BOUNDS if k in spec]
    if len(bounds) != 1:
        raise ClaimsError(f"detects needs exactly one of {', '.join(BOUNDS)}")
    x = spec[bounds[0]]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < 1:
        raise ClaimsError(f"detects.{bounds[0]} must lie between 0 and 1, got {x!r}")
    rng = spec["fires"]
    if not isinstance(rng, dict) or not rng or set(rng) - set(RANGE_KEYS) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in rng.values()):
        raise ClaimsError(f"detects.fires must map one or more of {', '.join(RANGE_KEYS)} to numbers, got {rng!r}")
    for column in (spec["column"], OUTCOME, CLUSTER, *([spec["among"]] if "among" in spec else [])):
        if column not in runs:
            raise ClaimsError(f"column {column!r} is not in the runs table")
    return bounds[0], float(x)


def units(runs: pd.DataFrame, spec: dict, measure: str) -> tuple[int, int, int, int, int]:
    """(clusters, hits when every relevant run of a cluster must hit, hits when any may, relevant runs, their hits)."""
    judged = runs[pd.to_numeric(runs[OUTCOME], errors="coerce").isin([0, 1])]
    if "among" in spec:
        judged = judged[pd.to_numeric(judged[spec["among"]], errors="coerce") == 1]
    fired = fires(judged[spec["column"]], spec["fires"])
    worse = pd.to_numeric(judged[OUTCOME]) == 1
    relevant, hit = (fired, worse) if measure == "precision" else (worse, fired)
    by = hit[relevant].groupby(judged.loc[relevant, CLUSTER].astype(str))
    return len(by), int(by.all().sum()), int(by.any().sum()), int(relevant.sum()), int(hit[relevant].sum())


def fewest_clusters(x: float, at_least: bool, level: float) -> int:
    """The fewest clusters, every one on the claimed side, whose exact one-sided test reaches ``level``."""
    p = x if at_least else 1 - x  # the probability of one hit (at least) / one miss (at most) at the claim's edge
    return math.ceil(math.log(level) / math.log(p))


def detects(spec: dict, tables: dict, reach: dict) -> Test:
    runs = tables["runs"]
    if "model" in spec:
        if "model" not in runs or spec["model"] not in set(runs["model"]):
            raise _Unresolved(f"model {spec['model']!r} has no runs in the table")
        runs = runs[runs["model"] == spec["model"]]
    bound, x = _check(spec, runs)
    measure, side = bound.split("_", 1)
    at_least = side == "at_least"
    n, k_all, k_any, n_runs, k_runs = units(runs, spec, measure)
    among = f" among {spec['among']} runs" if "among" in spec else ""
    what = f"{describe(spec['column'], spec['fires'])}: {measure} {'≥' if at_least else '≤'} {x:g}{among}"
    level = reach["level"]
    if n == 0:
        test = Test(math.nan, math.nan, "", one_sided=True, what=what)
        test.evidence = ("fired on no judged run" if measure == "precision" else "no judged run ends worse")
        test.blocked = f"{test.evidence}: nothing to count"
        test.needs = (f"runs where it {'fires' if measure == 'precision' else 'can miss'}: at least "
                      f"{fewest_clusters(x, at_least, level)} clusters of them, all on the claimed side")
        return test
    # support: at least X shown with the strict (all) count; at most X with the lenient (any) count; contradiction
    # the other way round, each an exact one-sided binomial test against X
    if at_least:
        p_support = float(st.binom.sf(k_all - 1, n, x))
        contradicted = float(st.binom.cdf(k_any, n, x)) <= level
    else:
        p_support = float(st.binom.cdf(k_any, n, x))
        contradicted = float(st.binom.sf(k_all - 1, n, x)) <= level
    lo = st.binomtest(k_all, n).proportion_ci(1 - 2 * level, "exact").low
    hi = st.binomtest(k_any, n).proportion_ci(1 - 2 * level, "exact").high
    clusters = f"{k_all} of {n} clusters" if k_all == k_any else f"{k_all}-{k_any} of {n} clusters"
    evidence = (f"{measure} {k_runs}/{n_runs} runs ({k_runs / n_runs:.0%}); {clusters}, exact one-sided bounds at "
                f"level {level:.2g}: [{lo:.2f}, {hi:.2f}]")
    test = Test(p_support, math.nan, evidence, one_sided=True, contradicted=bool(contradicted), what=what)
    need = fewest_clusters(x, at_least, level)
    if contradicted:
        pass
    elif need > n and need > reach["max_seeds"]:  # the engine's reach: "more than" marks it out of reach
        test.needs = f"more than {reach['max_seeds']} clusters: {need}, all on the claimed side ({n} here)"
    elif need > n:
        test.needs = f"at least {need} clusters, all on the claimed side ({n} here)"
    else:  # enough clusters, too many of them on the other side (or mixed, under the conservative count)
        test.needs = (f"more clusters wholly on the claimed side ({k_all if at_least else n - k_any} of {n} here; "
                      f"the fewest that could decide it: {need}, every one on that side)")
    return test


register("detects", "runs", {"column", "fires"}, {*BOUNDS, "among", "model"}, family="one-sided")(detects)

__all__ = ["detects", "fires", "describe", "units", "fewest_clusters", "BOUNDS", "OUTCOME", "CLUSTER"]

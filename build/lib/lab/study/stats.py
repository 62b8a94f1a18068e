"""Paired statistics for the summary table: each mode against the same model's FP32 runs, paired by seed.

Runs with the same seed share initialisation and data order across modes, so the seed-to-seed variation
cancels in the difference (mode - fp32) of a pair; the tests here work on those differences. All functions
are small and return NaN rather than raise when there is too little data (a study of one seed still gets
its table).
"""
from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as st
from statsmodels.stats.power import TTestIndPower, TTestPower

REFERENCE_MODE = "fp32"
#: the steps.csv columns that decide whether two modes trained identically
IDENTITY_COLUMNS = ("loss", "scale", "found_inf", "skipped")


def _by_seed(runs: pd.DataFrame, model: str, mode: str, metric: str) -> pd.Series:
    """One finite value per seed (NaN, inf and missing metrics dropped: old runs may lack a metric)."""
    rows = runs[(runs["model"] == model) & (runs["mode"] == mode)]
    if metric not in rows or rows.empty:
        return pd.Series(dtype=float)
    values = pd.to_numeric(rows[metric], errors="coerce").groupby(rows["seed"]).mean()
    return values[np.isfinite(values)]


def paired(runs_df: pd.DataFrame, model: str, mode: str, metric: str,
           reference: str = REFERENCE_MODE) -> tuple[np.ndarray, np.ndarray]:
    """(fp32 values, mode values) over the seeds both have, aligned by seed.

    Only shared seeds count: an unpaired run would bring its seed's offset into the difference.
    """
    ref, mine = _by_seed(runs_df, model, reference, metric), _by_seed(runs_df, model, mode, metric)
    seeds = sorted(ref.index.intersection(mine.index))
    return ref[seeds].to_numpy(dtype=float), mine[seeds].to_numpy(dtype=float)


def _mean_se(diffs) -> tuple[int, float, float]:
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    mean = float(d.mean()) if n else math.nan
    se = float(d.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    return n, mean, se


def t_interval(diffs, confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half width) of the Student-t interval (n - 1 degrees of freedom) for the mean difference.

    With a handful of seeds the normal approximation is far too narrow; n < 2 has no spread to go on, so the
    half width is NaN (nothing can be resolved).
    """
    n, mean, se = _mean_se(diffs)
    if n < 2:
        return mean, math.nan
    return mean, float(st.t.ppf(0.5 + confidence / 2, n - 1) * se)


def tost(diffs, margin: float, alpha: float = 0.05) -> tuple[bool, float]:
    """Two one-sided t-tests that the mean difference lies inside (-margin, +margin): (equivalent, p).

    "No resolved difference" is not evidence of no difference; equivalence must be shown against a margin
    fixed in advance. p is the larger of the two one-sided p-values; equivalent when p < alpha (the same as
    the 1 - 2*alpha t interval lying inside the margins). n < 2 cannot show anything: (False, NaN).
    """
    n, mean, se = _mean_se(diffs)
    if n < 2:
        return False, math.nan
    if se == 0:  # every pair differs by the same amount: the mean is known exactly
        p = 0.0 if abs(mean) < margin else 1.0
    else:
        p_lower = st.t.sf((mean + margin) / se, n - 1)   # H0: mean <= -margin
        p_upper = st.t.cdf((mean - margin) / se, n - 1)  # H0: mean >= +margin
        p = float(max(p_lower, p_upper))
    return bool(p < alpha), p


def pair_correlation(a, b) -> float:
    """Pearson r of fp32 against mode values across seeds: how much the pairing removes.

    High r means the seed dominates both runs and the paired interval is much narrower than an unpaired
    one would be. NaN when n < 3 (r of two points is always +-1) or either side has no variance.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def resolved(mean: float, half_width: float) -> bool:
    """True when the interval mean +- half width excludes 0 (NaN half width: not resolved)."""
    return bool(np.isfinite(half_width) and np.isfinite(mean) and abs(mean) > half_width)


def verdict(mean: float, half_width: float, equivalent: bool, higher_is_better: bool = True) -> str:
    """"cost resolved" / "gain resolved" / "equivalent" / "not resolved" for one mode's delta vs FP32.

    A resolved difference is reported first even when it is inside the margin (the `_equivalent` column
    still says so); for top-1 a negative delta is a cost, for validation loss a positive one.
    """
    if resolved(mean, half_width):
        return "gain resolved" if (mean > 0) == higher_is_better else "cost resolved"
    return "equivalent" if equivalent else "not resolved"


# --- sizing: how many seeds a t-test needs (lab/study/claims.py's reach) ---------------------------------------
def sd_from_interval(ci: float, n: float, confidence: float) -> float:
    """The SD behind a Student-t half width: ci = t_{(1+c)/2, n-1} * sd / sqrt(n); NaN when n < 2."""
    if not (math.isfinite(ci) and math.isfinite(n) and n >= 2):
        return math.nan
    return ci * math.sqrt(n) / float(st.t.ppf((1 + confidence) / 2, n - 1))


def pooled_sd(s1: float, n1: float, s2: float, n2: float) -> float:
    """Pooled SD of two samples (NaN unless both have a spread)."""
    if not all(math.isfinite(v) for v in (s1, n1, s2, n2)) or n1 < 2 or n2 < 2:
        return math.nan
    return math.sqrt(((n1 - 1) * s1 ** 2 + (n2 - 1) * s2 ** 2) / (n1 + n2 - 2))


SEEDS_CAP = 10 ** 6  # seeds_needed stops counting here (a tiny effect at a large spread): "more than ..."


def _solver(paired: bool):
    return TTestPower() if paired else TTestIndPower()


def seeds_needed(effect_size: float, alpha: float, power: float, alternative: str = "two-sided",
                 paired: bool = True, cap: int | None = None) -> float:
    """Paired seeds (TTestPower: one sample of differences) or seeds per row (TTestIndPower) for a t-test at
    level `alpha` to reach `power` at standardized effect `effect_size`, rounded up, at least 2; inf when the
    effect is 0 or on the wrong side (no number of seeds would do it) or needs more than `cap`."""
    cap = SEEDS_CAP if cap is None else cap
    if not effect_size > 0:
        return math.inf
    if math.isinf(effect_size):  # no spread at all: the smallest study with an interval does it
        return 2
    solver = _solver(paired)
    kw = dict(effect_size=effect_size, alpha=alpha, alternative=alternative)
    nobs = "nobs" if paired else "nobs1"

    def short(k: int) -> bool:  # power rises with k; statsmodels' noncentral t can give NaN far past the
        return bool(solver.power(**kw, **{nobs: k}) < power)  # target, so NaN counts as reached

    if not short(2):
        return 2
    if short(cap):
        return math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = float(np.asarray(solver.solve_power(**kw, power=power, **{nobs: None})).reshape(-1)[0])
    if not math.isfinite(n):  # the root finder gave up: search whole seeds
        lo, hi = 2, 4  # short(lo); grow hi until it is not
        while short(hi) and hi < cap:
            lo, hi = hi, min(2 * hi, cap)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if short(mid) else (lo, mid)
        n = hi
    return max(2, math.ceil(n))


# --- modes that trained identically ----------------------------------------------------------------------
def _identity_columns(run_dir) -> tuple | None:
    """The identity columns of a run's steps.csv as raw strings (None when the file or a column is missing)."""
    path = Path(run_dir) / "steps.csv"
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not set(IDENTITY_COLUMNS) <= set(reader.fieldnames or ()):
            return None
        return tuple(tuple(row[c] for c in IDENTITY_COLUMNS) for row in reader)


def _same_runs(a: dict, b: dict, columns: dict) -> int:
    """Number of shared seeds when the two modes match byte for byte in every one of them, else 0."""
    shared = sorted(set(a) & set(b))
    for seed in shared:
        ca, cb = columns[a[seed]], columns[b[seed]]
        if ca is None or cb is None or ca != cb:
            return 0
    return len(shared)


def identical_modes(run_dirs_by_mode: dict) -> list[tuple[str, list[str], int]]:
    """Groups of modes whose steps.csv loss, scale, found_inf and skipped columns are identical.

    `run_dirs_by_mode` is {mode: {seed: run_dir}} for one model, in table order. A policy whose extra rule
    never fired trains exactly like the policy it extends; its row then repeats that mode's numbers and is
    no independent evidence. A mode joins the first earlier mode it matches on every shared seed (at least
    one). Returns [(reference mode, [identical later modes], runs compared)], runs compared being the
    smallest number of shared seeds in the group.
    """
    columns = {d: _identity_columns(d) for seeds in run_dirs_by_mode.values() for d in seeds.values()}
    groups: list[tuple[str, list[str], int]] = []
    refs: list[str] = []
    for mode, seeds in run_dirs_by_mode.items():
        for i, ref in enumerate(refs):
            n = _same_runs(run_dirs_by_mode[ref], seeds, columns)
            if n:
                head, members, m = groups[i]
                groups[i] = (head, members + [mode], min(m, n) if members else n)
                break
        else:
            refs.append(mode)
            groups.append((mode, [], 0))
    return [g for g in groups if g[1]]

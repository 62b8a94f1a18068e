"""Small paired helpers for the summary table: values by seed, the t interval of a column over seeds, the exact
interval of a Poisson rate (overflow), the pair correlation, and modes that trained identically. The verdicts
themselves come from lab/study/inference.py (pooled seed spread, examples, multiplicity). All functions return NaN
rather than raise when there is too little data (a study of one seed still gets its table).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as st

from lab.core import runfiles

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


def poisson_rate_interval(count: float, exposure: float, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Garwood) interval of a Poisson rate: ``count`` events over ``exposure`` (statsmodels' exact-c);
    (NaN, NaN) without exposure. Unlike a t interval over seeds, it never has zero width: 0 events in 500 steps is
    a rate below 0.0074/step."""
    if not exposure or exposure <= 0 or not np.isfinite(count) or not np.isfinite(exposure):
        return math.nan, math.nan
    from statsmodels.stats.rates import confint_poisson
    low, high = confint_poisson(count, exposure, method="exact-c", alpha=1 - confidence)
    return float(low), float(high)


def pair_correlation(a, b) -> float:
    """Pearson r of fp32 against mode values across seeds: how much the pairing removes.

    High r means the seed dominates both runs and the paired interval is much narrower than an unpaired
    one would be. NaN when n < 3 (r of two points is always +-1) or either side has no variance.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


# --- modes that trained identically ----------------------------------------------------------------------
def _identity_columns(run_dir) -> tuple | None:
    """The identity columns of a run's steps.csv as raw strings (None when the file or a column is missing)."""
    path = Path(run_dir) / "steps.csv"
    if not path.is_file():
        return None
    columns, rows = runfiles.read_csv(path)  # RunFileError naming the file when it is damaged
    if not set(IDENTITY_COLUMNS) <= set(columns):
        return None
    return tuple(tuple(row[c] for c in IDENTITY_COLUMNS) for row in rows)


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

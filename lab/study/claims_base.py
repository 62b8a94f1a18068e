"""What every claim test is built from (lab/study/claims.py and lab/study/claims_trajectory.py): the record of one
test, the reasons a claim cannot be decided, and reading a summary row's cells."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

NOT_RESOLVED = "not resolved"


class _Unresolved(Exception):
    """Raised while testing when the table cannot decide (missing row, column, value or spread): its reason."""


class _OutOfReach(_Unresolved):
    """No number of seeds decides it here (horizon, no growth interval, no spread to size)."""


@dataclass(frozen=True)
class Outcome:
    verdict: str
    evidence: str


@dataclass
class Test:
    """One claim's two one-sided p-values (NaN: that side cannot be tested), its evidence, and what more seeds
    would need ('' when no sizing applies): seeds as (low, high) for the declared effect."""
    p_support: float
    p_contradict: float
    evidence: str
    seeds: tuple = (math.nan, math.nan)
    seeds_what: str = ""
    blocked: str = ""        # why it cannot be decided here
    blocked_kind: str = NOT_RESOLVED
    parts: list = field(default_factory=list)


def _row(summary: pd.DataFrame, model: str, mode: str) -> pd.Series:
    rows = summary[(summary["model"] == model) & (summary["mode"] == mode)]
    if rows.empty:
        raise _Unresolved(f"no rows for {model} {mode}")
    return rows.iloc[0]


def _missing(row: pd.Series, column: str) -> _Unresolved:
    return _Unresolved(f"{row['model']} {row['mode']}: summary.csv has no {column} column (re-run aggregate)")


def _value(row: pd.Series, column: str) -> float:
    if column not in row.index:
        raise _missing(row, column)
    return float(pd.to_numeric(row[column], errors="coerce"))


def _optional(row: pd.Series, column: str) -> float:
    """A numeric column that older summaries lack: NaN when absent."""
    return _value(row, column) if column in row.index else math.nan


def _text(row: pd.Series, column: str) -> str:
    v = row.get(column, "")
    return v if isinstance(v, str) else ""

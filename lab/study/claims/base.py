"""The claims engine's common ground: the verdict vocabulary, the record of one test, the reasons a claim cannot be
decided, reading a summary row's cells, and the registry of test kinds.

Every kind is one function and one registry line (``register``): its name, the table it reads (``summary``: the
aggregated summary's cells, one row per (model, mode): lab/study/claims/summary.py, trajectory.py; ``runs``:
one row per run, paired by seed, with a per-unit ``shape`` table beside it: lab/study/claims/runs.py), its required
and optional keys (the claims file's validation, lab/study/claims/file.py) and how its test enters the Holm family
(lab/study/claims/): ``two-sided`` kinds give a support and a contradiction p-value, both family members;
``one-sided`` kinds give a support p-value, and their contradiction is a bound at Holm's first level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from lab.core.errors import ConfigError

SUPPORTED, CONTRADICTED, NOT_RESOLVED, OUT_OF_REACH = "supported", "contradicted", "not resolved", "out of reach"
VERDICTS = (SUPPORTED, CONTRADICTED, NOT_RESOLVED, OUT_OF_REACH)
TABLES = ("summary", "runs")
#: a claim's keys besides its one predicate (`requires`: another claim above it that must be supported first;
#: `reads`: the table its kind reads, when not the file's)
CLAIM_KEYS = ("id", "text", "source", "requires", "reads")
#: what "in reach" means: the power a sized study should have, the most seeds (paired, or per row) it may
#: take, and how many of the policy's growth intervals an overflow claim's runs must span
REACH = dict(power=0.8, max_seeds=20, horizon_intervals=3)


class ClaimsError(ConfigError):
    """A claims file or table that cannot be checked; the message names the claim and what is allowed."""


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
    """One test: its one-sided p-values (NaN: that side cannot be tested), its evidence, and what more seeds would
    need ('' when no sizing applies): seeds as (low, high) for the declared effect. A one-sided kind's test has no
    contradiction p-value: ``contradicted`` says its bound at Holm's first level rules the claim out, ``needs`` what
    would decide it, ``what`` the test in words."""
    p_support: float
    p_contradict: float
    evidence: str
    seeds: tuple = (math.nan, math.nan)
    seeds_what: str = ""
    blocked: str = ""        # why it cannot be decided here
    blocked_kind: str = NOT_RESOLVED
    parts: list = field(default_factory=list)
    one_sided: bool = False
    contradicted: bool = False
    what: str = ""
    needs: str = ""
    excludes_effect: bool = False   # one-sided: its bound rules out the declared effect (contradicted unless shown)


@dataclass(frozen=True)
class Kind:
    """One registered test kind: ``test(body, tables, reach) -> Test`` (``tables``: {name: DataFrame}), the table it
    reads, its keys, how it enters the family, and ``needs(body, summary, reach) -> str`` (the claim in words)."""
    name: str
    reads: str
    test: Callable
    required: frozenset
    optional: frozenset = frozenset()
    family: str = "two-sided"
    needs: Callable | None = None


#: (table read, kind name) -> Kind: every test kind of every study's claims
REGISTRY: dict[tuple[str, str], Kind] = {}


def register(name: str, reads: str, required=(), optional=(), family: str = "two-sided", needs=None):
    """Decorator: register ``fn`` as the test of kind ``name`` on table ``reads`` (a later registration of the same
    name and table replaces it)."""
    if reads not in TABLES or family not in ("two-sided", "one-sided"):
        raise ValueError(f"register {name}: reads one of {TABLES}, family two-sided or one-sided")

    def add(fn):
        REGISTRY[(reads, name)] = Kind(name, reads, fn, frozenset(required), frozenset(optional), family, needs)
        return fn
    return add


def kinds(reads: str) -> dict[str, Kind]:
    """The kinds registered on one table, by name."""
    return {name: k for (table, name), k in REGISTRY.items() if table == reads}


def run_test(kind: str, body, tables, reach: dict, reads: str = "summary") -> Test:
    """The test of one predicate (``tables``: {name: DataFrame}, or the summary alone); a table that cannot test it
    gives NaN p-values and the reason."""
    if isinstance(tables, pd.DataFrame):
        tables = {"summary": tables}
    try:
        return REGISTRY[(reads, kind)].test(body, tables, reach)
    except _Unresolved as why:
        return Test(math.nan, math.nan, "", blocked=str(why),
                    blocked_kind=OUT_OF_REACH if isinstance(why, _OutOfReach) else NOT_RESOLVED)


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

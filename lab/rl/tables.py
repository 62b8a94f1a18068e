"""What the RL study's two tables share (lab/rl/grpo_aggregate.py, GRPO's; lab/rl/dpo_aggregate.py, the DPO family's):
a finished run's metrics read, the mean over seeds, a share and a paired difference as table cells."""
from __future__ import annotations

import math
from pathlib import Path

from lab.core.runfiles import RunFileError, read_json

__all__ = ["read_metrics", "mean_of", "pct", "delta_cell"]


def read_metrics(path: Path, key: str, what: str) -> dict:
    """A finished run's metrics.json: missing (the run has not finished), damaged (RunFileError, one line naming it)
    or without ``key`` (not ``what``'s metrics) refused."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run has not finished")
    data = read_json(path)
    if key not in data:
        raise RunFileError(f"{path}: not {what}'s metrics (no {key})")
    return data


def mean_of(values) -> float:
    """The mean of the values that are numbers (None and NaN left out); NaN when none is."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else math.nan


def pct(x: float) -> str:
    """A share as a percentage cell; NaN as a dash."""
    return "—" if math.isnan(x) else f"{100 * x:.1f}%"


def delta_cell(row: dict) -> str:
    """A row's paired Δ (a share) ± its half width, in points. An interval of zero width (every seed the same
    difference) or of one seed decides nothing: shown as not resolved, not read as exact."""
    if math.isnan(row["delta_vs_fp32"]):
        return "—"
    half = row["delta_half_width"]
    width = "n.r. (zero width)" if half == 0 else "n.r. (one seed)" if math.isnan(half) else f"{100 * half:.1f} pp"
    return f"{100 * row['delta_vs_fp32']:+.1f} ± {width}"

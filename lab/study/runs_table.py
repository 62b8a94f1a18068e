"""A study's per-run table (results/*/tables/runs.csv): one row per finished run, what the claims engine's per-run kinds
(lab/study/claims/runs.py, `reads: runs`) pair by seed. Written by `lab aggregate` for every study (workflow/rules/
aggregate.smk) and read by the recipe study's tables (lab/report/recipes_table.py).

Columns: model, mode, seed, recipe (the mode's recipe, else its precision), val_loss (a diverged run counts as ln C,
the uniform guess, as the summary does), top1, diverged (0/1), train_time_s, the recipe study's saturated/flushed
shares per tensor kind (NaN for a run without a recipe), then every other number of the run's metrics.json in its
order there (the census's flushed_activation, subnormal_activation, ..., overflow and skipped steps, scales, ...). A run
that failed (raised) is a crash to fix, not a result: it has no row.
"""
from __future__ import annotations

import numbers

import numpy as np
import pandas as pd

KINDS = ("activation", "weight", "gradient")
SHARES = [f"{what}_{kind}_pct" for what in ("saturated", "flushed") for kind in KINDS]
RUN_COLUMNS = ["model", "mode", "seed", "recipe", "val_loss", "top1", "diverged", "train_time_s", *SHARES]
#: metrics.json fields the leading columns already hold (under their own names) or that are not measurements
_TAKEN = {"seed", "final_val_loss", "final_top1", "diverged", "train_time_s"}


def _is_number_field(values: pd.Series) -> bool:
    """Every value present is a number (not a bool: a flag of the run's settings), and one is present."""
    present = [v for v in values if v is not None and not (isinstance(v, float) and np.isnan(v))]
    return bool(present) and all(isinstance(v, numbers.Number) and not isinstance(v, (bool, np.bool_))
                                 for v in present)


def runs_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run from ``metrics``: one row per run's metrics.json (lab.study.aggregate.load_runs,
    lab.report.load.load_metrics), sorted by model, mode and seed."""
    m = metrics.reset_index(drop=True)
    if m.empty:
        return pd.DataFrame(columns=RUN_COLUMNS)
    # a run's status (metrics.json; older runs: its diverged flag): a run that failed (raised) is a crash to fix,
    # not a result, with no loss to count
    status = m["status"] if "status" in m else pd.Series(
        np.where(m.get("diverged", pd.Series(False, index=m.index)).fillna(False).astype(bool), "diverged", "ok"))
    m = m[status.isin(["ok", "diverged"]).to_numpy()].reset_index(drop=True)
    status = status[status.isin(["ok", "diverged"])].reset_index(drop=True)
    if m.empty:
        return pd.DataFrame(columns=RUN_COLUMNS)
    out = pd.DataFrame({"model": m["model"], "mode": m["mode"], "seed": m["seed"].astype(int)})
    out["recipe"] = m["recipe"] if "recipe" in m else None
    out["recipe"] = out["recipe"].fillna(m["precision"])
    diverged = status == "diverged"
    def column(name):  # absent: runs from before it existed
        return pd.to_numeric(m[name], errors="coerce") if name in m else pd.Series(np.nan, index=m.index)
    loss, chance = column("final_val_loss"), np.log(column("num_classes"))
    out["val_loss"] = loss.where(np.isfinite(loss) & ~diverged, chance)
    out["top1"] = m.get("final_top1", np.nan)
    out["diverged"] = diverged.astype(int)
    out["train_time_s"] = m.get("train_time_s", np.nan)
    for col in SHARES:
        out[col] = pd.to_numeric(m[col], errors="coerce") if col in m else np.nan
    extra = [c for c in m.columns if c not in out and c not in _TAKEN and _is_number_field(m[c])]
    out = pd.concat([out, m[extra].apply(pd.to_numeric, errors="coerce")], axis=1)
    return out.sort_values(["model", "mode", "seed"], kind="stable").reset_index(drop=True)[[*RUN_COLUMNS, *extra]]

"""What a run's steps.csv says about overflow and convergence beyond metrics.json: overflows once the
scale has settled, per 1000 steps and per growth attempt; the scale it settled at; the steps and seconds to a
declared training loss.

The definitions are declared before a study's runs, in its claims file's `trajectory:` block (configs/
claims_multimodal.yaml):

    trajectory: {settled_after: 50, target_train_loss: 0.5, window: 20, margin_log: 0.2}

- **settled**: the steps from `settled_after` on, once the scale came down from its initial value and training
  began (the descent from 2^16 ended by step 25 in every run of the default study). Overflows there are what a
  policy's probing and the gradients' growth cost; a growth attempt is a step after which the scale rose.
- **settled scale**: the median scale over the settled steps (what the source's guidance table's init_scale is
  about: where the scale lives).
- **time to target**: the first step at which the mean training loss of the last `window` applied steps is at or
  under `target_train_loss`; its seconds are the run's empty-gradient steps' time plus that many steps at the
  run's mean seconds per step. A run that never gets there counts at its length (a lower bound, marked).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import runfiles
from lab.study import stats

DEFAULTS = {"settled_after": 50, "target_train_loss": None, "window": 20, "margin_log": 0.2}
#: per-run values stored in the summary by seed (JSON), for the claims that pair or count seeds
BY_SEED = ("steps_to_target", "settled_scale")


class TrajectoryError(ValueError):
    """A malformed `trajectory:` block."""


def validate(raw, where: str) -> dict:
    """The `trajectory:` block over DEFAULTS: integer settled_after >= 0 and window >= 1, a positive target loss
    (or none) and margin_log."""
    if raw is None:
        return dict(DEFAULTS)
    if not isinstance(raw, dict) or set(raw) - set(DEFAULTS):
        raise TrajectoryError(f"{where}: trajectory: expected a mapping of {', '.join(DEFAULTS)}; found {raw!r}")
    spec = {**DEFAULTS, **raw}
    for key, low in (("settled_after", 0), ("window", 1)):
        v = spec[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise TrajectoryError(f"{where}: trajectory.{key}: expected an integer >= {low}; found {v!r}")
    for key in ("target_train_loss", "margin_log"):
        v = spec[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise TrajectoryError(f"{where}: trajectory.{key}: expected a positive number; found {v!r}")
    return spec


def run_values(run_dir, metrics: dict, spec: dict) -> dict:
    """One run's settled overflows, growth attempts and scale, skipped steps, and time to target."""
    d = runfiles.read_csv_frame(Path(run_dir) / "steps.csv", runfiles.STEP_COLUMNS, usecols=runfiles.STEP_COLUMNS)
    settled = d["step"] >= spec["settled_after"]
    rose = d["scale"].shift(-1) > d["scale"]  # the update of this step raised the scale: a growth attempt
    out = {"settled_overflows": int(d.loc[settled, "found_inf"].sum()), "settled_steps": int(settled.sum()),
           "settled_growths": int((rose & settled).sum()),
           "settled_scale": float(d.loc[settled, "scale"].median()) if settled.any() else math.nan,
           "skipped_count": int(d["skipped"].sum())}
    target = spec["target_train_loss"]
    if target is None:
        return out
    applied = d[d["skipped"] == 0]
    mean = applied["loss"].rolling(spec["window"]).mean()
    hit = applied.loc[mean <= target, "step"]
    steps = len(d)
    reached = len(hit) > 0
    n = int(hit.iloc[0]) + 1 if reached else steps
    settle = _number(metrics.get("settle_time_s"), 0.0)  # a row of runs without it holds NaN
    per_step = (_number(metrics.get("train_time_s"), math.nan) - settle) / max(steps, 1)
    return {**out, "steps_to_target": n, "reached_target": reached, "seconds_to_target": settle + n * per_step}


def _number(v, default: float) -> float:
    """A metrics value as a float; ``default`` for a missing one (None, or NaN in a table of runs)."""
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def add_run_values(runs: pd.DataFrame, run_dirs, spec: dict | None) -> pd.DataFrame:
    """`runs` (one row per run, from metrics.json) with each run's trajectory values; unchanged without a spec."""
    if spec is None:
        return runs
    values = [run_values(d, row, spec) for d, row in zip(run_dirs, runs.to_dict("records"))]
    out = pd.concat([runs.reset_index(drop=True), pd.DataFrame(values)], axis=1)
    out["margin_log"] = spec["margin_log"]  # the time-to-target claims' declared margin, carried to the summary
    return out


def summary_columns(g: pd.DataFrame, confidence: float) -> dict:
    """A (model, mode) group's settled overflows pooled over its seeds (per 1000 settled steps and per growth
    attempt, each with its exact Poisson interval), skipped steps over all steps, time to target, and the per-seed
    values the claims pair or count (JSON by seed)."""
    if "settled_overflows" not in g:
        return {}
    count, exposure, growths = (float(g[c].sum()) for c in ("settled_overflows", "settled_steps", "settled_growths"))
    low, high = stats.poisson_rate_interval(count, exposure, confidence)
    out = {"margin_log": float(g["margin_log"].iloc[0]), "settled_overflow_count": count, "settled_exposure": exposure,
           "settled_per_1k": 1000 * count / exposure if exposure else np.nan,
           "settled_per_1k_low": 1000 * low, "settled_per_1k_high": 1000 * high, "settled_growths": growths,
           "skipped_count": float(g["skipped_count"].sum()), "skipped_exposure": float(g["steps"].sum())}
    # overflows per growth attempt: the count's exact interval over the attempts (a policy that never grew: none)
    glow, ghigh = stats.poisson_rate_interval(count, growths, confidence) if growths else (np.nan, np.nan)
    out.update(settled_per_growth=count / growths if growths else np.nan, settled_per_growth_low=glow,
               settled_per_growth_high=ghigh)
    if "steps_to_target" in g:
        out.update(steps_to_target_mean=float(g["steps_to_target"].mean()),
                   seconds_to_target_mean=float(g["seconds_to_target"].mean()),
                   reached_target=f"{int(g['reached_target'].sum())}/{len(g)}")
    for column in BY_SEED:
        if column in g:
            out[f"{column}_by_seed"] = json.dumps({str(int(s)): float(v) for s, v in zip(g["seed"], g[column])})
    return out


COLUMNS = ["margin_log", "settled_overflow_count", "settled_exposure", "settled_per_1k", "settled_per_1k_low",
           "settled_per_1k_high",
           "settled_growths", "settled_per_growth", "settled_per_growth_low", "settled_per_growth_high",
           "skipped_count", "skipped_exposure", "steps_to_target_mean", "seconds_to_target_mean", "reached_target",
           *(f"{c}_by_seed" for c in BY_SEED)]


def by_seed(row: pd.Series, column: str) -> dict[int, float]:
    """A summary row's per-seed values of ``column`` ({} when the row has none)."""
    raw = row.get(f"{column}_by_seed")
    if not isinstance(raw, str) or not raw:
        return {}
    return {int(k): float(v) for k, v in json.loads(raw).items()}


def to_markdown(table: pd.DataFrame, spec: dict, confidence: float) -> str:
    """summary.md's second table: overflow once the scale settled, skipped steps and time to target, per row."""
    rows = table[table["settled_overflow_count"].notna()] if "settled_overflow_count" in table else table.iloc[0:0]
    if rows.empty:
        return ""
    pct = f"{100 * confidence:g}%"
    target = spec["target_train_loss"]
    header = ["model", "mode", f"settled overflows (steps ≥ {spec['settled_after']})",
              f"per 1000 settled steps ({pct} exact)", "growth attempts", f"overflows per growth attempt ({pct} exact)",
              "skipped steps (all)", "settled scale (median by seed)"]
    if target is not None:
        header += [f"steps to train loss ≤ {target:g}", "seconds to it", "reached"]
    lines = [f"### Overflow once the scale settled{' and time to target' if target is not None else ''}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def interval(v, lo, hi, scale=1.0):
        return "—" if not np.isfinite(v) else f"{scale * v:.2f} [{scale * lo:.2f}, {scale * hi:.2f}]"

    for _, r in rows.iterrows():
        scales = by_seed(r, "settled_scale") if r["precision"] == "fp16" else {}  # FP32 and bf16: no scale
        cells = [r["model"], r["mode"], f"{r['settled_overflow_count']:.0f} in {r['settled_exposure']:.0f}",
                 interval(r["settled_per_1k"], r["settled_per_1k_low"], r["settled_per_1k_high"]),
                 f"{r['settled_growths']:.0f}",
                 interval(r["settled_per_growth"], r["settled_per_growth_low"], r["settled_per_growth_high"]),
                 f"{r['skipped_count']:.0f} in {r['skipped_exposure']:.0f}",
                 ", ".join(f"2^{math.log2(v):.0f}" if v > 0 else f"{v:g}" for v in scales.values()) or "—"]
        if target is not None:
            seconds = r["seconds_to_target_mean"]
            cells += [f"{r['steps_to_target_mean']:.0f}", f"{seconds:.1f}" if np.isfinite(seconds) else "—",
                      r["reached_target"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    note = (f"Settled: the steps from {spec['settled_after']} on (declared before the runs); a growth attempt is a step "
            "after which the scale rose. Rates pool the seeds' counts over their steps, with the exact (Garwood) "
            "Poisson interval; the settled scale is each seed's median scale over those steps (FP16 rows).")
    if target is not None:
        note += (f" Time to target: the first step at which the mean training loss of the last {spec['window']} applied "
                 f"steps is ≤ {target:g}; seconds add the empty-gradient steps' time; a run that never gets there "
                 "counts at its length (see `reached`).")
    lines += ["", note + " lab/study/trajectory.py.", ""]
    return "\n".join(lines)

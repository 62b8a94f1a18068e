"""The DPO family's runs as one table (``python -m lab rl-dpo-aggregate``): per mode, over its seeds, the held-out
preference accuracy at the start and the end, the end's difference from dpo-fp32 on the same seed (mean and 95%
Student-t interval over the seeds: each seed's whole run is the independent unit), the implicit reward margin, the
steps whose margins were not finite, skipped and overflow steps, the final scale. Descriptive, like lab/rl/aggregate.py.
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.core import files
from lab.core.runfiles import RunFileError, read_json
from lab.rl.dpo_study import dpo_run_folder
from lab.study.stats import t_interval

__all__ = ["dpo_aggregate", "COLUMNS", "REFERENCE"]

REFERENCE = "dpo-fp32"
COLUMNS = ["mode", "learner", "sum", "policy", "seeds", "accuracy_start", "accuracy_end", "delta_vs_fp32",
           "delta_half_width", "margin_end", "reward_accuracy_end", "nonfinite_steps", "skipped_steps",
           "overflow_steps", "final_scale"]
MEANS = ["accuracy_start", "accuracy_end", "margin_end", "reward_accuracy_end", "nonfinite_steps", "skipped_steps",
         "overflow_steps", "final_scale"]  # metrics.json's, averaged over the seeds


def _metrics(results_dir, mode: str, seed: int) -> dict:
    path = dpo_run_folder(results_dir, mode, seed) / "metrics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the DPO run {mode} seed {seed} has not finished")
    data = read_json(path)  # a damaged file: RunFileError, one line naming it
    if "accuracy_end" not in data:
        raise RunFileError(f"{path}: not a DPO run's metrics (no accuracy_end)")
    return data


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else math.nan


def dpo_aggregate(study: dict, csv_path: Path, md_path: Path) -> list[dict]:
    """``study``: load_rl_study's, with its ``dpo`` block."""
    dpo, results = study["dpo"], study["results_dir"]
    runs = {(m, s): _metrics(results, m, s) for m in dpo["modes"] for s in dpo["seeds"]}  # all read before writing
    reference = REFERENCE if REFERENCE in dpo["modes"] else None
    rows = []
    for name, mode in dpo["modes"].items():
        mine = [runs[(name, s)] for s in dpo["seeds"]]
        diffs = ([runs[(name, s)]["accuracy_end"] - runs[(reference, s)]["accuracy_end"] for s in dpo["seeds"]]
                 if reference and name != reference else [])
        mean, half = t_interval(diffs) if diffs else (math.nan, math.nan)
        rows.append({"mode": name, "learner": mode.learner, "sum": mode.sum,
                     "policy": mode.scaler["policy"] if mode.scaler else "none", "seeds": len(mine),
                     "delta_vs_fp32": mean, "delta_half_width": half, **{k: _mean(m.get(k) for m in mine)
                                                                         for k in MEANS}})
    files.atomic_write_csv(csv_path, rows, COLUMNS)
    files.atomic_write_text(md_path, _markdown(rows, dpo))
    return rows


def _markdown(rows: list[dict], dpo: dict) -> str:
    def pct(x):
        return "—" if math.isnan(x) else f"{100 * x:.1f}%"

    def delta(r):
        if math.isnan(r["delta_vs_fp32"]):
            return "—"
        half = r["delta_half_width"]
        # an interval of zero width (every seed the same difference) decides nothing: shown, not read as exact
        width = ("n.r. (zero width)" if half == 0 else "n.r. (one seed)" if math.isnan(half)
                 else f"{100 * half:.1f} pp")
        return f"{100 * r['delta_vs_fp32']:+.1f} ± {width}"
    lines = ["| mode | learner / sum | scaler | held-out accuracy (start → end) | Δ end vs dpo-fp32 (same seed) | "
             "reward margin (end) | non-finite steps | skipped / overflow steps | final scale |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['learner']} / {r['sum']} | {r['policy']} | {pct(r['accuracy_start'])} → "
                     f"{pct(r['accuracy_end'])} | {delta(r)} | {r['margin_end']:.3f} | {r['nonfinite_steps']:.1f} | "
                     f"{r['skipped_steps']:.1f} / {r['overflow_steps']:.1f} | {r['final_scale']:g} |")
    t = dpo["train"]
    lines += ["", f"{len(dpo['seeds'])} seeds per mode; {t['steps']} DPO steps of {t['pairs']} pairs (lr {t['lr']:g}, "
              f"beta {t['beta']:g}; the rejected continuation: {t['k']} token(s) replaced, {t['corruption']}) from one "
              f"FP32 base, the frozen base as the reference. Held-out accuracy: the share of 256 held-out pairs where "
              "the policy gives the real continuation the higher sequence log-probability (FP32 forward, FP32 sum). "
              "Δ: mean over seeds of the paired difference, ± the half width of its 95% Student-t interval (seeds as "
              "the unit; no multiplicity correction: descriptive). Reward margin: the mean implicit reward margin on "
              "the held-out pairs. Means over seeds elsewhere. Generated by `python -m lab rl-dpo-aggregate`."]
    return "\n".join(lines) + "\n"

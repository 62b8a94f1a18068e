"""Aggregate run directories into the study's summary tables (CSV and Markdown)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from lab import runio

SUMMARY_COLUMNS = [
    "model", "mode", "precision", "scaler", "n_seeds", "n_diverged",
    "top1_mean", "top1_std", "top1_delta_vs_fp32", "final_train_loss",
    "overflow_steps", "skipped_pct", "update_ratio", "final_scale", "min_scale", "max_scale",
    "throughput", "speedup_vs_fp32", "peak_memory_mb", "memory_saving_vs_fp32_pct",
    "activation_mb", "activation_saving_vs_fp32_pct", "fp16_path", "device",
]


def load_runs(run_dirs) -> pd.DataFrame:
    """One row per run from each run directory's metrics.json (missing files are an error)."""
    rows = []
    for d in run_dirs:
        path = Path(d) / "metrics.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the run at {d} has not finished")
        rows.append(json.loads(path.read_text()))
    if not rows:
        raise ValueError("no runs to aggregate")
    return pd.DataFrame(rows)


def _paired_delta(runs: pd.DataFrame, model: str, mode: str) -> float:
    """Mean over seeds of (mode top-1 - FP32 top-1) on the same seed; NaN without FP32 partners."""
    mine = runs[(runs.model == model) & (runs["mode"] == mode)].set_index("seed")["final_top1"]
    ref = runs[(runs.model == model) & (runs["mode"] == "fp32")].set_index("seed")["final_top1"]
    common = mine.index.intersection(ref.index)
    return float((mine[common] - ref[common]).mean()) if len(common) else float("nan")


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (model, mode), g in runs.groupby(["model", "mode"], sort=False):
        steps = g["steps"].clip(lower=1)
        out.append({
            "model": model, "mode": mode, "precision": g["precision"].iloc[0], "scaler": g["scaler"].iloc[0],
            "n_seeds": int(g["seed"].nunique()), "n_diverged": int(g["diverged"].sum()),
            "top1_mean": g["final_top1"].mean(), "top1_std": g["final_top1"].std(ddof=1) if len(g) > 1 else 0.0,
            "top1_delta_vs_fp32": _paired_delta(runs, model, mode),
            "final_train_loss": g["final_train_loss"].mean(),
            "overflow_steps": g["overflow_steps"].mean(),
            "skipped_pct": 100.0 * (g["skipped_steps"] / steps).mean(),
            "update_ratio": g["update_ratio"].mean(),
            "final_scale": g["final_scale"].median(), "min_scale": g["min_scale"].min(),
            "max_scale": g["max_scale"].max(),
            "throughput": g["throughput_samples_per_s"].mean(),
            "peak_memory_mb": g["peak_memory_mb"].mean(),
            "activation_mb": g["activation_mb"].mean(),
            "fp16_path": g["fp16_path"].iloc[0], "device": g["device_name"].iloc[0],
        })
    table = pd.DataFrame(out)
    for model, g in table.groupby("model"):
        base = g[g["mode"] == "fp32"]
        if base.empty:
            continue
        b = base.iloc[0]
        idx = g.index
        table.loc[idx, "speedup_vs_fp32"] = table.loc[idx, "throughput"] / b["throughput"]
        table.loc[idx, "memory_saving_vs_fp32_pct"] = 100 * (1 - table.loc[idx, "peak_memory_mb"] / b["peak_memory_mb"])
        table.loc[idx, "activation_saving_vs_fp32_pct"] = 100 * (1 - table.loc[idx, "activation_mb"] / b["activation_mb"])
    for col in SUMMARY_COLUMNS:
        if col not in table:
            table[col] = np.nan
    return table[SUMMARY_COLUMNS]


def _fmt(v, digits=2):
    if isinstance(v, str):
        return v
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "—"
    if isinstance(v, (int, np.integer)):
        return str(v)
    if abs(v) >= 1e5:
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def to_markdown(table: pd.DataFrame) -> str:
    """Source study's columns first (model, FP32 top-1, mode top-1, loss, overflow count), then the rest."""
    fp32 = table[table["mode"] == "fp32"].set_index("model")["top1_mean"]
    header = ["model", "mode", "FP32 top-1 %", "mode top-1 % (± std)", "Δ vs FP32 (pp, paired)",
              "final train loss", "overflow steps", "skipped %", "update ratio", "final scale",
              "samples/s", "speedup vs FP32", "peak mem MB", "activation MB", "act. saving %", "diverged"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in table.iterrows():
        cells = [r["model"], r["mode"], _fmt(100 * fp32.get(r["model"], np.nan), 1),
                 f"{_fmt(100 * r['top1_mean'], 1)} ± {_fmt(100 * r['top1_std'], 1)}",
                 _fmt(100 * r["top1_delta_vs_fp32"], 1), _fmt(r["final_train_loss"], 3),
                 _fmt(r["overflow_steps"], 1), _fmt(r["skipped_pct"], 1), _fmt(r["update_ratio"], 3),
                 _fmt(r["final_scale"], 0), _fmt(r["throughput"], 0), _fmt(r["speedup_vs_fp32"], 2),
                 _fmt(r["peak_memory_mb"], 0), _fmt(r["activation_mb"], 1),
                 _fmt(r["activation_saving_vs_fp32_pct"], 1), f"{int(r['n_diverged'])}/{int(r['n_seeds'])}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    devices = ", ".join(sorted(set(table["device"].astype(str))))
    paths = ", ".join(sorted(set(table["fp16_path"].astype(str)) - {"n/a"}))
    notes = [
        "", f"Device: {devices}. FP16 path: {paths or 'n/a'}. Seeds per row: "
        f"{', '.join(sorted(set(table['n_seeds'].astype(str))))}.",
        "Top-1 is final validation accuracy; Δ is the mean over seeds of (mode − FP32) on the same seed. "
        "Overflow steps are per run (mean over seeds). Peak memory on CPU is the process's peak RSS; "
        "activation MB is what autograd saved for backward in one step.",
    ]
    return "\n".join(lines + notes) + "\n"


def aggregate(run_dirs, csv_path, md_path) -> pd.DataFrame:
    table = summarize(load_runs(run_dirs))
    runio.atomic_write_text(csv_path, table.to_csv(index=False))
    runio.atomic_write_text(md_path, to_markdown(table))
    return table

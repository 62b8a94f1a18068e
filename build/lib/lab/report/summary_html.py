"""The study's summary table as a self-contained HTML page, for the Snakemake report (`python -m lab
summary-html results/tables/summary.csv --out results/tables/summary.html`)."""
from __future__ import annotations

import numpy as np
import pandas as pd

SUMMARY_HTML_COLUMNS = {  # summary.csv column -> heading (percentages are converted)
    "model": "model", "mode": "mode", "precision": "precision", "scaler": "scaler", "n_seeds": "seeds",
    "n_diverged": "diverged", "top1_mean": "top-1 %", "top1_std": "± std", "top1_delta_vs_fp32": "Δ vs FP32 (pp)",
    "top1_delta_ci": "Δ top-1 95% CI (pp)", "top1_verdict": "top-1 verdict", "val_loss_mean": "val loss (nats)",
    "val_loss_delta": "Δ val loss", "val_loss_delta_ci": "Δ val loss 95% CI", "val_loss_verdict": "val-loss verdict",
    "final_train_loss": "final loss", "overflow_steps": "overflow steps", "skipped_pct": "skipped %",
    "update_ratio": "update ratio", "final_scale": "final scale", "min_scale": "min scale",
    "max_scale": "max scale", "throughput": "samples/s", "speedup_vs_fp32": "speedup",
    "peak_memory_mb": "peak mem MB", "activation_mb": "activation MB",
    "activation_saving_vs_fp32_pct": "act. saving %", "device": "device",
}


def summary_html(summary: pd.DataFrame, title: str = "Loss-Scale Lab: study summary") -> str:
    """A self-contained HTML page of the summary table (lab.report.load.load_summary), one block per model."""
    t = summary.copy()
    for col in ("top1_mean", "top1_std", "top1_delta_vs_fp32", "top1_delta_ci"):
        if col in t:
            t[col] = 100 * pd.to_numeric(t[col], errors="coerce")
    cols = [c for c in SUMMARY_HTML_COLUMNS if c in t]
    t = t[cols].rename(columns=SUMMARY_HTML_COLUMNS)

    def fmt(v):
        if isinstance(v, (float, np.floating)):
            if not np.isfinite(v):
                return "—"
            return f"{v:.3g}" if abs(v) >= 1e5 else f"{v:.4g}" if abs(v) < 1 else f"{v:.2f}".rstrip("0").rstrip(".")
        return str(v)

    html = t.to_html(index=False, border=0, classes="summary", na_rep="—", formatters={c: fmt for c in t.columns},
                     escape=True)
    style = ("body{font-family:system-ui,sans-serif;margin:1em;font-size:13px}"
             "table.summary{border-collapse:collapse}table.summary td,table.summary th{padding:3px 8px;"
             "border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}"
             "table.summary th{background:#f3f3f3;position:sticky;top:0}"
             "table.summary td:nth-child(-n+4){text-align:left}")
    note = ("Top-1 is final validation accuracy (mean and sample std over seeds); Δ is the mean over seeds of "
            "(mode − FP32) on the same seed (top-1 in percentage points, validation loss in nats), with the half "
            "width of its 95% Student-t interval; the verdicts are summary.md's. Overflow steps are per run (mean "
            "over seeds).")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style>"
            f"</head><body><h3>{title}</h3>{html}<p>{note}</p></body></html>\n")

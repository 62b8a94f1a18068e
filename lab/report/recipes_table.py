"""The FP8/FP4 recipe study's tables (configs/fp8.yaml; `python -m lab recipes-tables`): from the study's per-run table
(runs.csv, lab/study/runs_table.py: what configs/claims_fp8.yaml decides on; `lab aggregate` writes it for every
study, this command too when given run folders), one row per (model, mode) (recipes.csv / recipes.md): validation loss
against BF16 and FP32 on the same seeds, and the share of values each recipe saturated (clipped at the format's
maximum) and flushed (non-zero values quantized to zero) per tensor kind, over the census steps.

A diverged run is a result, not a gap: its validation loss counts as ln C (the uniform guess; what the default
study's aggregate does) and the row says how many diverged. The intervals are each mode's paired (same seed)
difference, a 95% Student t interval over seeds: a description; the claims file decides, with its own error rate.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as st

from lab.core import files
from lab.core.runfiles import read_csv_frame
from lab.report.load import load_metrics, mode_order, model_order
from lab.study import runs_table as per_run
from lab.study.runs_table import KINDS, RUN_COLUMNS, SHARES  # noqa: F401  (their home: lab/study/runs_table.py)


def runs_table(source) -> pd.DataFrame:
    """One row per finished run of `source` (a results folder or runs/ folder): the study's per-run table
    (lab/study/runs_table.py, what `lab aggregate --runs-csv` writes)."""
    return per_run.runs_table(load_metrics(source))


def _paired(runs: pd.DataFrame, model: str, mode: str, ref: str) -> tuple[float, float, int]:
    """Mean and 95% t half width of mode - ref on the seeds both have (nan when fewer than 2)."""
    a = runs[(runs.model == model) & (runs["mode"] == mode)].set_index("seed")["val_loss"]
    b = runs[(runs.model == model) & (runs["mode"] == ref)].set_index("seed")["val_loss"]
    d = (a - b).dropna()
    if len(d) < 2:
        return (float(d.mean()) if len(d) else math.nan), math.nan, len(d)
    return float(d.mean()), float(st.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))), len(d)


def recipe_table(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for model in model_order(runs.model.unique()):
        here = runs[runs.model == model]
        for mode in mode_order(here["mode"].unique()):
            r = here[here["mode"] == mode]
            row = {"model": model, "mode": mode, "recipe": r["recipe"].iloc[0], "n_seeds": len(r),
                   "n_diverged": int(r["diverged"].sum()), "val_loss": r["val_loss"].mean()}
            for ref in ("bf16", "fp32"):  # the reference's own row: no difference to show
                row[f"delta_vs_{ref}"], row[f"delta_vs_{ref}_ci"], row[f"n_pairs_{ref}"] = (
                    (math.nan, math.nan, 0) if mode == ref else _paired(runs, model, mode, ref))
            row.update({c: r[c].mean() for c in SHARES})
            row["train_time_s"] = r["train_time_s"].mean()
            rows.append(row)
    return pd.DataFrame(rows)


def _delta(mean, half) -> str:
    if not np.isfinite(mean):
        return "—"
    return f"{mean:+.3f}" if not np.isfinite(half) else f"{mean:+.3f} ± {half:.3f}"


def _pct(x) -> str:
    return "—" if not np.isfinite(x) else "0" if x == 0 else f"{x:.3g}"


def to_markdown(table: pd.DataFrame) -> str:
    lines = []
    for model in table.model.unique():
        t = table[table.model == model]
        lines += [f"### {model}", "",
                  "| mode | val loss | Δ vs bf16 | Δ vs fp32 | saturated % (act / weight / grad) | "
                  "flushed % (act / weight / grad) | diverged |",
                  "|---|---|---|---|---|---|---|"]
        for _, r in t.iterrows():
            sat = " / ".join(_pct(r[f"saturated_{k}_pct"]) for k in KINDS)
            flu = " / ".join(_pct(r[f"flushed_{k}_pct"]) for k in KINDS)
            lines.append(f"| {r['mode']} | {r['val_loss']:.3f} | {_delta(r['delta_vs_bf16'], r['delta_vs_bf16_ci'])} "
                         f"| {_delta(r['delta_vs_fp32'], r['delta_vs_fp32_ci'])} | {sat} | {flu} | "
                         f"{r['n_diverged']}/{r['n_seeds']} |")
        lines.append("")
    lines.append("Validation loss (nats; a diverged run counts as ln C) and its paired difference from BF16 and FP32 "
                 "on the same seeds, ± the half width of a 95% t interval over seeds (a description: "
                 "configs/claims_fp8.yaml's claims decide, Holm across the file). Saturated: of all elements a "
                 "recipe quantized, the share beyond the format's maximum (clipped); flushed: of the non-zero "
                 "elements, the share quantized to zero; per tensor kind (activation: the linears' inputs; weight; "
                 "gradient: their output gradients), over the census steps. No step time here: a study's runs share "
                 "a machine with whatever else runs; the cost is a side-by-side benchmark (results/fp8/step_cost.md). "
                 "Generated by `python -m lab recipes-tables`.")
    return "\n".join(lines) + "\n"


def write(source, out_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """recipes.csv and recipes.md (and runs.csv when `source` is run folders) in `out_dir`; `source`: results
    folder(s), runs/ folders or run directories, or the study's runs.csv (what the workflow passes: `lab aggregate`
    wrote it), which is read, not written again."""
    out_dir = Path(out_dir)
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    from_csv = len(sources) == 1 and str(sources[0]).endswith(".csv")
    runs = read_csv_frame(Path(sources[0]), ("model", "mode", "seed")) if from_csv else runs_table(source)
    table = recipe_table(runs)
    if not from_csv:
        files.atomic_write_text(out_dir / "runs.csv", runs.to_csv(index=False, lineterminator="\n"))
    files.atomic_write_text(out_dir / "recipes.csv", table.to_csv(index=False, lineterminator="\n"))
    files.atomic_write_text(out_dir / "recipes.md", to_markdown(table))
    return runs, table

"""Aggregate run directories into the study's summary tables (CSV and Markdown).

Each (model, mode) row is compared with the same model's FP32 runs paired by seed (lab/study/stats.py): a paired
mean difference with its Student-t interval, a TOST equivalence test against margins fixed in the study
config (`stats:`), and a verdict, for top-1 and for validation loss.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import files
from lab.core.config import STUDY_DEFAULTS, deep_merge
from lab.study import stats

#: summary metric -> (metrics.json field, higher is better); runs without the field give NaN
STAT_METRICS = {"top1": ("final_top1", True), "val_loss": ("final_val_loss", False)}
STAT_SUFFIXES = ["delta", "delta_ci", "resolved", "equivalent", "verdict", "pair_corr", "n_pairs"]
STAT_COLUMNS = ["n_pairs", "top1_delta", *(f"top1_{s}" for s in STAT_SUFFIXES[1:]),
                "val_loss_mean", *(f"val_loss_{s}" for s in STAT_SUFFIXES)]

SUMMARY_COLUMNS = [
    "model", "mode", "precision", "scaler", "n_seeds", "n_diverged",
    "top1_mean", "top1_std", "top1_delta_vs_fp32", "final_train_loss",
    "overflow_steps", "overflow_initial", "overflow_in_training", "overflow_per_1k", "overflow_per_1k_sd",
    "overflow_per_1k_ci", "growth_attempts", "growth_interval", "steps_mean",
    "skipped_pct", "update_ratio", "final_scale", "min_scale", "max_scale",
    "flushed_activation", "subnormal_activation", "flushed_param", "subnormal_param",
    "throughput", "speedup_vs_fp32", "peak_memory_mb", "memory_saving_vs_fp32_pct",
    "activation_mb", "activation_saving_vs_fp32_pct", "fp16_path", "device",
    *STAT_COLUMNS,
    "tokens_per_backward", "loss_divisor", "regime_tokens_per_step", "n_val", "val_loss_uniform", "val_loss_unigram",
    "confidence", "top1_margin", "val_loss_margin",
]


def stats_config(cfg: dict | None = None) -> dict:
    """The study's `stats:` settings over the defaults (confidence 0.95; margins top1 0.01, val_loss 0.05)."""
    return deep_merge(STUDY_DEFAULTS["stats"], cfg or {})


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


def _seeds(runs: pd.DataFrame, model: str, mode: str) -> set:
    return set(runs.loc[(runs["model"] == model) & (runs["mode"] == mode), "seed"])


def _metric_stats(runs: pd.DataFrame, model: str, mode: str, name: str, cfg: dict) -> dict:
    """The paired columns of one metric for one (model, mode) row (see lab/study/stats.py for the tests)."""
    field, higher_is_better = STAT_METRICS[name]
    ref, mine = stats.paired(runs, model, mode, field)
    mean, half = stats.t_interval(mine - ref, cfg["confidence"])
    equivalent, _ = stats.tost(mine - ref, cfg["margins"][name], alpha=1 - cfg["confidence"])
    return {f"{name}_delta": mean, f"{name}_delta_ci": half, f"{name}_resolved": stats.resolved(mean, half),
            f"{name}_equivalent": equivalent,
            f"{name}_verdict": "reference" if mode == stats.REFERENCE_MODE
            else stats.verdict(mean, half, equivalent, higher_is_better),
            f"{name}_pair_corr": stats.pair_correlation(ref, mine), f"{name}_n_pairs": len(ref)}


def _paired_stats(runs: pd.DataFrame, model: str, mode: str, cfg: dict) -> dict:
    out = {"n_pairs": len(_seeds(runs, model, mode) & _seeds(runs, model, stats.REFERENCE_MODE))}
    for name in STAT_METRICS:
        out.update(_metric_stats(runs, model, mode, name, cfg))
    out["top1_delta_vs_fp32"] = out["top1_delta"]  # the column's older name, kept for its readers
    return out


def _mean_of(g: pd.DataFrame, field: str) -> float:
    """Mean of a metrics.json field over a group's runs; NaN when the runs predate the field."""
    return pd.to_numeric(g[field], errors="coerce").mean() if field in g else np.nan


def _overflow_columns(g: pd.DataFrame, confidence: float) -> dict:
    """Overflow split into the initial descent and in training (lab/run/train.py _overflow_split), per run means;
    the in-training rate per 1000 steps with its spread and t-interval across seeds (rows compared by the
    claims with a Welch interval)."""
    rate = pd.to_numeric(g["overflow_per_1k"], errors="coerce").dropna() if "overflow_per_1k" in g \
        else pd.Series(dtype=float)
    _, half = stats.t_interval(rate, confidence)
    return {"overflow_initial": _mean_of(g, "overflow_initial"),
            "overflow_in_training": _mean_of(g, "overflow_in_training"),
            "overflow_per_1k": rate.mean() if len(rate) else np.nan,
            "overflow_per_1k_sd": rate.std(ddof=1) if len(rate) > 1 else np.nan,
            "overflow_per_1k_ci": half, "growth_attempts": _mean_of(g, "growth_attempts"),
            "growth_interval": _mean_of(g, "growth_interval"), "steps_mean": g["steps"].mean()}


def summarize(runs: pd.DataFrame, stats_cfg: dict | None = None) -> pd.DataFrame:
    """One row per (model, mode); `stats_cfg` is the study's `stats:` block (defaults when None)."""
    cfg = stats_config(stats_cfg)
    out = []
    for (model, mode), g in runs.groupby(["model", "mode"], sort=False):
        steps = g["steps"].clip(lower=1)
        out.append({
            "model": model, "mode": mode, "precision": g["precision"].iloc[0], "scaler": g["scaler"].iloc[0],
            "n_seeds": int(g["seed"].nunique()), "n_diverged": int(g["diverged"].sum()),
            "top1_mean": g["final_top1"].mean(), "top1_std": g["final_top1"].std(ddof=1) if len(g) > 1 else 0.0,
            "val_loss_mean": _mean_of(g, "final_val_loss"),
            "final_train_loss": g["final_train_loss"].mean(),
            "overflow_steps": g["overflow_steps"].mean(),
            **_overflow_columns(g, cfg["confidence"]),
            "skipped_pct": 100.0 * (g["skipped_steps"] / steps).mean(),
            "update_ratio": g["update_ratio"].mean(),
            "final_scale": g["final_scale"].median(), "min_scale": g["min_scale"].min(),
            "max_scale": g["max_scale"].max(),
            "throughput": g["throughput_samples_per_s"].mean(),
            "peak_memory_mb": g["peak_memory_mb"].mean(),
            "activation_mb": g["activation_mb"].mean(),
            "fp16_path": g["fp16_path"].iloc[0], "device": g["device_name"].iloc[0],
            **_paired_stats(runs, model, mode, cfg),
            **{c: _mean_of(g, c) for c in ("flushed_activation", "subnormal_activation", "flushed_param",
                                           "subnormal_param")},
            **{c: _mean_of(g, c) for c in ("tokens_per_backward", "loss_divisor", "regime_tokens_per_step", "n_val",
                                           "val_loss_uniform", "val_loss_unigram")},
            "confidence": cfg["confidence"], "top1_margin": cfg["margins"]["top1"],
            "val_loss_margin": cfg["margins"]["val_loss"],
        })
    table = pd.DataFrame(out)
    for model, g in table.groupby("model"):
        base = g[g["mode"] == "fp32"]
        if base.empty:
            continue
        b = base.iloc[0]
        idx = g.index
        table.loc[idx, "speedup_vs_fp32"] = table.loc[idx, "throughput"] / b["throughput"]
        for saving, measure in (("memory_saving_vs_fp32_pct", "peak_memory_mb"),
                                ("activation_saving_vs_fp32_pct", "activation_mb")):
            table.loc[idx, saving] = 100 * (1 - table.loc[idx, measure] / b[measure])
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


def _delta_cell(r, name: str, scale: float, digits: int) -> str:
    """`Δ ± CI` of one metric, in bold when the interval excludes 0; `ref` on the FP32 row itself."""
    if r["mode"] == stats.REFERENCE_MODE:
        return "ref"
    d, ci = r[f"{name}_delta"], r[f"{name}_delta_ci"]
    if pd.isna(d):
        return "—"
    cell = f"{_fmt(scale * d, digits)} ± {_fmt(scale * ci, digits)}"
    return f"**{cell}**" if bool(r[f"{name}_resolved"]) else cell


def _overflow_cell(r) -> str:
    """`initial descent + in training` overflow steps per run (the total alone when the runs predate the split)."""
    if pd.isna(r.get("overflow_initial", np.nan)):
        return _fmt(r["overflow_steps"], 1)
    return f"{_fmt(r['overflow_initial'], 1)} + {_fmt(r['overflow_in_training'], 1)}"


def _pct_cell(v) -> str:
    return "—" if v is None or pd.isna(v) else f"{100 * v:.1f}"


def _rate_cell(r) -> str:
    """In-training overflow steps per 1000 steps ± its t half width across seeds."""
    rate, ci = r.get("overflow_per_1k", np.nan), r.get("overflow_per_1k_ci", np.nan)
    return _fmt(rate, 2) if pd.isna(ci) else f"{_fmt(rate, 2)} ± {_fmt(ci, 2)}"


def _row_cells(r, fp32_top1: float) -> list[str]:
    return [r["model"], r["mode"], _fmt(100 * fp32_top1, 1),
            f"{_fmt(100 * r['top1_mean'], 1)} ± {_fmt(100 * r['top1_std'], 1)}",
            _delta_cell(r, "top1", 100, 1), _fmt(r["val_loss_mean"], 3), _delta_cell(r, "val_loss", 1, 3),
            _fmt(r["final_train_loss"], 3), _pct_cell(r.get("flushed_activation")),
            _pct_cell(r.get("subnormal_activation")), _overflow_cell(r), _rate_cell(r),
            _fmt(r["growth_attempts"], 1),
            r["top1_verdict"], r["val_loss_verdict"], _fmt(r["top1_pair_corr"], 2),
            _fmt(r["val_loss_pair_corr"], 2), _fmt(int(r["n_pairs"])), _fmt(r["skipped_pct"], 1),
            _fmt(r["update_ratio"], 3), _fmt(r["final_scale"], 0),
            _fmt(r["throughput"], 0), _fmt(r["speedup_vs_fp32"], 2), _fmt(r["peak_memory_mb"], 0),
            _fmt(r["activation_mb"], 1), _fmt(r["activation_saving_vs_fp32_pct"], 1),
            f"{int(r['n_diverged'])}/{int(r['n_seeds'])}"]


def _regime_line(table: pd.DataFrame) -> str:
    """Per family, what one backward averages over and the divisor before it: the FP16 magnitudes of a step of
    their product (docs/lm-regime.md)."""
    if "tokens_per_backward" not in table or table["tokens_per_backward"].isna().all():
        return ""
    parts = []
    for model, g in table.groupby("model", sort=False):
        per, div = g["tokens_per_backward"].iloc[0], g["loss_divisor"].iloc[0]
        if pd.isna(per):
            continue
        parts.append(f"{model} {per:g} per backward" + (f" ÷ {div:g} (the magnitudes of a {per * div:g} step)"
                                                       if div and div != 1 else ""))
    return "Backward regime (samples, or tokens for the LM): " + "; ".join(parts) + "." if parts else ""


def identical_lines(groups) -> list[str]:
    """One sentence per group of modes that trained identically: [(model, reference, [modes], n_runs)]."""
    lines = []
    for model, ref, members, n in groups:
        rule = "its rule" if len(members) == 1 else "their rules"
        lines.append(f"{', '.join(members)} = {ref} in all {n} runs of {model}: {rule} never fired "
                     "(same loss, scale and skips at every step).")
    return lines


def _stats_notes(table: pd.DataFrame, cfg: dict) -> list[str]:
    conf, m = cfg["confidence"], cfg["margins"]
    compared = table[table["mode"] != stats.REFERENCE_MODE]
    pairs = ", ".join(sorted({str(int(n)) for n in compared["n_pairs"]})) or "none"
    return [
        f"Δ is the paired mean over seeds of (mode − FP32) on the same seed ± the half width of its "
        f"{100 * conf:g}% Student-t interval (n − 1 degrees of freedom); **bold** when the interval excludes 0. "
        f"Top-1 Δ in percentage points, validation loss (mean, in nats) Δ in nats. n pairs per row: {pairs}.",
        f"Verdict: cost / gain resolved when the interval excludes 0 (a lower top-1 or a higher validation loss "
        f"is a cost; listed so even when inside the margin); else equivalent when TOST (two one-sided t-tests, "
        f"α = {1 - conf:.2g}) puts the mean difference within ±{100 * m['top1']:g} pp top-1 and "
        f"±{m['val_loss']:g} nats validation loss, margins fixed in the study config before the runs; "
        "else not resolved. Pair r: Pearson r of FP32 and mode values across seeds (— under 3 pairs).",
    ]


def planted_steps(runs: pd.DataFrame) -> list[int]:
    """The steps at which any of these runs planted a fault (metrics.json planted_steps; none in a real run)."""
    if "planted_steps" not in runs:
        return []
    return sorted({int(s) for steps in runs["planted_steps"] if isinstance(steps, list) for s in steps})


def planted_lines(runs: pd.DataFrame | None) -> list[str]:
    """One line per (model, mode) whose runs planted faults (train.faults): where, and what was counted."""
    if runs is None or "planted_steps" not in runs:
        return []
    out = []
    for (model, mode), g in runs.groupby(["model", "mode"], sort=False):
        planted = planted_steps(g)
        if planted:
            out.append(f"Planted faults, {model} / {mode}: steps {', '.join(map(str, planted))}; counted "
                       f"{g['overflow_steps'].mean():g} overflow and {g['skipped_steps'].mean():g} skipped steps "
                       f"per run (`python -m lab diagnose` compares them step by step).")
    return [""] + out if out else []


def to_markdown(table: pd.DataFrame, stats_cfg: dict | None = None, identical=(), runs=None) -> str:
    """Source study's columns first (model, FP32 top-1, mode top-1, loss, overflow count), then the rest.

    `identical` is [(model, reference mode, [modes], n_runs)] from lab.study.stats.identical_modes, one note each.
    """
    cfg = stats_config(stats_cfg)
    fp32 = table[table["mode"] == stats.REFERENCE_MODE].set_index("model")["top1_mean"]
    ci = f"± {100 * cfg['confidence']:g}% CI"
    header = ["model", "mode", "FP32 top-1 %", "mode top-1 % (± std)", f"Δ vs FP32 (pp, paired, {ci})",
              "val loss (nats)", f"Δ val loss ({ci})", "final train loss", "act. grads flushed %",
              "act. grads subnormal %", "overflow steps (descent + in training)",
              f"in-training overflow /1k steps ({ci})", "growth attempts", "top-1 verdict",
              "val-loss verdict", "pair r top-1", "pair r val loss", "n pairs", "skipped %", "update ratio",
              "final scale", "samples/s", "speedup vs FP32", "peak mem MB", "activation MB", "act. saving %",
              "diverged"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join(str(c) for c in _row_cells(r, fp32.get(r["model"], np.nan))) + " |")
    devices = ", ".join(sorted(set(table["device"].astype(str))))
    paths = ", ".join(sorted(set(table["fp16_path"].astype(str)) - {"n/a"}))
    notes = [
        "", f"Device: {devices}. FP16 path: {paths or 'n/a'}. Seeds per row: "
        f"{', '.join(sorted(set(table['n_seeds'].astype(str))))}.",
        *_stats_notes(table, cfg),
        "Top-1 is final validation accuracy. Overflow steps are per run (mean over seeds), split into the initial "
        "descent (before the run's first clean step) and in training (after it); the in-training rate is per 1000 "
        "steps after the first clean step; growth attempts count the steps at which the policy raised the scale. "
        "Act. grads flushed / subnormal: of the activation-gradient values FP32 holds non-zero, the share FP16 "
        "flushes to zero / keeps only as subnormals, over every census step: an FP16 run's FP32 replay at the "
        "scale it used, an FP32 run's counterfactual at scale 1 (FP16 without a loss scale). "
        "Peak memory on CPU "
        "is the process's peak RSS; activation MB is what autograd saved for backward in one step.",
    ]
    regime = _regime_line(table)
    if regime:
        notes.append(regime)
    same = identical_lines(identical)
    return "\n".join(lines + notes + ([""] + same if same else []) + planted_lines(runs)) + "\n"


FINDINGS_MARKERS = ("<!-- findings:start -->", "<!-- findings:end -->")
#: the modes the findings table shows, in this order, when the summary has them
FINDINGS_MODES = ("fp16-noscale", "fp16-static128", "fp16-static1024", "fp16-dynamic", "bf16", "fp16-hysteresis",
                  "fp16-deepspeed", "fp16-amax", "fp16-gradnorm", "fp16-warmup", "fp16-dynamic-fallback")
_SHORT = {"cost resolved": "**cost**", "gain resolved": "**gain**", "equivalent": "equiv.",
          "not resolved": "n.r."}


def findings_markdown(table: pd.DataFrame) -> str:
    """The README's compact findings: per mode (rows) and family (columns), the paired validation-loss Δ
    against FP32 (nats, ± the half width of its interval) and its verdict, under the FP32 loss itself."""
    modes = [m for m in FINDINGS_MODES if m in set(table["mode"])]
    modes += [m for m in dict.fromkeys(table["mode"]) if m not in modes and m != stats.REFERENCE_MODE]
    families = list(dict.fromkeys(table["model"]))
    by = table.set_index(["model", "mode"])
    lines = ["| mode | " + " | ".join(families) + " |", "|---|" + "---|" * len(families),
             "| fp32 (val loss, nats) | " + " | ".join(
                 _fmt(by["val_loss_mean"].get((f, stats.REFERENCE_MODE), np.nan), 3) for f in families) + " |"]
    for m in modes:
        cells = []
        for f in families:
            if (f, m) not in by.index or pd.isna(by.loc[(f, m), "val_loss_delta"]):
                cells.append("—")
                continue
            r = by.loc[(f, m)]
            ci = "" if pd.isna(r["val_loss_delta_ci"]) else f" ± {r['val_loss_delta_ci']:.3f}"
            cells.append(f"{r['val_loss_delta']:+.3f}{ci} {_SHORT.get(r['val_loss_verdict'], r['val_loss_verdict'])}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    conf = table["confidence"].dropna().iloc[0] if "confidence" in table and table["confidence"].notna().any() \
        else 0.95
    return "\n".join(lines + ["", f"Validation loss of each mode minus FP32 on the same seed (nats), mean over seeds "
                               f"± the half width of its {100 * conf:g}% Student-t interval; **cost** / **gain**: "
                               "the interval excludes 0; equiv.: within the study's margin (TOST); n.r.: not "
                               "resolved. Generated from results/tables/summary.csv by `make claims`."]) + "\n"


def run_dirs_by_model(run_dirs, runs: pd.DataFrame) -> dict:
    """{model: {mode: {seed: run_dir}}} from load_runs' rows (same order as run_dirs), modes in table order."""
    out: dict = {}
    for d, (model, mode, seed) in zip(run_dirs, runs[["model", "mode", "seed"]].itertuples(index=False)):
        out.setdefault(model, {}).setdefault(mode, {})[seed] = Path(d)
    return out


def identical_groups(run_dirs, runs: pd.DataFrame, table: pd.DataFrame) -> list:
    """[(model, reference, [modes], n_runs)] for every model, modes in the summary table's order."""
    groups = []
    for model, by_mode in run_dirs_by_model(run_dirs, runs).items():
        order = [m for m in table.loc[table["model"] == model, "mode"] if m in by_mode]
        for ref, members, n in stats.identical_modes({m: by_mode[m] for m in order}):
            groups.append((model, ref, members, n))
    return groups


def aggregate(run_dirs, csv_path, md_path, stats_cfg: dict | None = None) -> pd.DataFrame:
    """Write summary.csv and summary.md; `stats_cfg` is the study's `stats:` block (defaults when None)."""
    run_dirs = list(run_dirs)
    runs = load_runs(run_dirs)
    table = summarize(runs, stats_cfg)
    files.atomic_write_text(csv_path, table.to_csv(index=False))
    files.atomic_write_text(md_path, to_markdown(table, stats_cfg, identical_groups(run_dirs, runs, table), runs))
    return table

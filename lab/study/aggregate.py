"""Aggregate run directories into the study's summary tables (CSV and Markdown).

Each (model, mode) row is compared with the same model's FP32 runs on the same seeds and validation examples
(lab/study/verdicts.py, lab/study/inference.py): the mean difference, an interval from the family's pooled seed
spread and the examples' own variance, TOST against the margins declared in configs/claims.yaml, and a verdict
for top-1 and for validation loss, decided over the whole table under a stated error rate.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import files, runfiles
from lab.core.config import STUDY_DEFAULTS
from lab.core.kernel_paths import FP16_PATH_CONTRACT, speed_cell
from lab.core.study import deep_merge
from lab.study import stats, trajectory, verdicts
from lab.study.planted import planted_lines
from lab.study.runs_table import runs_table

#: summary metric -> (metrics.json field, higher is better); runs without the field give NaN
STAT_METRICS = {m: v[:2] for m, v in verdicts.METRICS.items()}
STAT_SUFFIXES = [*verdicts.CELL_SUFFIXES, "pair_corr"]
STAT_COLUMNS = ["n_pairs", "top1_delta", *(f"top1_{s}" for s in STAT_SUFFIXES[1:]),
                "val_loss_mean", *(f"val_loss_{s}" for s in STAT_SUFFIXES)]

SUMMARY_COLUMNS = [
    "model", "mode", "precision", "scaler", "n_seeds", "n_diverged",
    "top1_mean", "top1_std", "top1_delta_vs_fp32", "final_train_loss",
    "overflow_steps", "overflow_initial", "overflow_in_training", "overflow_per_1k", "overflow_per_1k_sd",
    "overflow_per_1k_low", "overflow_per_1k_high", "growth_attempts", "growth_interval", "steps_mean",
    "overflow_count", "overflow_exposure", "grows",
    "skipped_pct", "update_ratio", "final_scale", "min_scale", "max_scale",
    "flushed_activation", "subnormal_activation", "flushed_param", "subnormal_param",
    "flushed_adapter", "subnormal_adapter", "below_normal_adapter", "below_normal_adapter_sd",
    "below_normal_activation", "below_normal_activation_sd",
    "throughput", "speedup_vs_fp32", "peak_memory_mb", "memory_saving_vs_fp32_pct",
    "activation_mb", "activation_saving_vs_fp32_pct", "fp16_path", "device",
    *STAT_COLUMNS,
    "tokens_per_backward", "loss_divisor", "regime_tokens_per_step", "n_val", "val_loss_uniform", "val_loss_unigram",
    "confidence", "error_rate",
]


def stats_config(cfg: dict | None = None) -> dict:
    """The study's `stats:` settings over the defaults (confidence 0.95; margins top1 0.01, val_loss 0.05)."""
    return deep_merge(STUDY_DEFAULTS["stats"], cfg or {})


def load_runs(run_dirs) -> pd.DataFrame:
    """One row per run from each run directory's metrics.json (missing files are an error, and damaged ones:
    lab.core.runfiles.RunFileError)."""
    rows = []
    for d in run_dirs:
        path = Path(d) / "metrics.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the run at {d} has not finished")
        rows.append(runfiles.read_json(path))
    if not rows:
        raise ValueError("no runs to aggregate")
    return pd.DataFrame(rows)


def _seeds(runs: pd.DataFrame, model: str, mode: str) -> set:
    return set(runs.loc[(runs["model"] == model) & (runs["mode"] == mode), "seed"])


def _pair_corr(runs: pd.DataFrame, model: str, mode: str) -> dict:
    """Pearson r of FP32 and mode values across seeds, per metric (how much pairing by seed removes)."""
    out = {}
    for name, (field, _) in STAT_METRICS.items():
        ref, mine = stats.paired(runs, model, mode, field)
        out[f"{name}_pair_corr"] = stats.pair_correlation(ref, mine)
    return out


def _mean_of(g: pd.DataFrame, field: str) -> float:
    """Mean of a metrics.json field over a group's runs; NaN when the runs predate the field."""
    return pd.to_numeric(g[field], errors="coerce").mean() if field in g else np.nan


def _overflow_columns(g: pd.DataFrame, confidence: float) -> dict:
    """Overflow split into the initial descent and in training (lab/run/train.py _overflow_split), per run means;
    the in-training rate per 1000 steps pooled over seeds (events over the steps after the first clean one) with
    its exact Poisson interval: 0-2 events per run give a t interval over seeds of zero width, this never does."""
    rate = pd.to_numeric(g["overflow_per_1k"], errors="coerce").dropna() if "overflow_per_1k" in g \
        else pd.Series(dtype=float)
    count, exposure = _sum_of(g, "overflow_in_training"), _sum_of(g, "steps_after_first_clean")
    low, high = stats.poisson_rate_interval(count, exposure, confidence)
    pooled = 1000.0 * count / exposure if exposure and exposure > 0 else np.nan
    return {"overflow_initial": _mean_of(g, "overflow_initial"),
            "overflow_in_training": _mean_of(g, "overflow_in_training"),
            "overflow_per_1k": pooled, "overflow_per_1k_sd": rate.std(ddof=1) if len(rate) > 1 else np.nan,
            "overflow_per_1k_low": 1000.0 * low, "overflow_per_1k_high": 1000.0 * high,
            "growth_attempts": _mean_of(g, "growth_attempts"),
            "growth_interval": _mean_of(g, "growth_interval"), "steps_mean": g["steps"].mean(),
            # the exact Poisson comparison of two rows (claims): in-training overflow steps over their exposure
            "overflow_count": count, "overflow_exposure": exposure, "grows": _grows(g)}


def _sum_of(g: pd.DataFrame, field: str) -> float:
    return pd.to_numeric(g[field], errors="coerce").sum(min_count=1) if field in g else np.nan


def _grows(g: pd.DataFrame) -> str:
    """How the row's policy raises its scale: 'interval' (every growth_interval clean steps), 'never' (a fixed
    scale, or no scaling), 'other' (it grows by its own rule, amax-history: no horizon can be set)."""
    if g["precision"].iloc[0] != "fp16":
        return "never"
    if "growth_interval" in g and pd.to_numeric(g["growth_interval"], errors="coerce").notna().any():
        return "interval"
    return "never" if g["scaler"].iloc[0] in ("none", "static") else "other"


def summarize(runs: pd.DataFrame, stats_cfg: dict | None = None, outcomes: list | None = None,
              declared: dict | None = None) -> pd.DataFrame:
    """One row per (model, mode); `stats_cfg` is the study's `stats:` block (defaults when None), `outcomes` each
    run's outcomes.npz (lab/study/verdicts.read_outcomes; None: run-level values only), `declared` the margins
    and effects of interest per family (configs/claims.yaml `declared:`)."""
    cfg = stats_config(stats_cfg)
    outcomes = outcomes if outcomes is not None else [None] * len(runs)
    cells = verdicts.verdict_columns(runs.reset_index(drop=True), outcomes, declared or {}, cfg["margins"],
                                     cfg["confidence"]).set_index(["model", "mode"])
    out = []
    for (model, mode), g in runs.groupby(["model", "mode"], sort=False):
        steps = g["steps"].clip(lower=1)
        cell = cells.loc[(model, mode)].to_dict() if (model, mode) in cells.index else {}
        if mode == stats.REFERENCE_MODE:  # against itself: Δ 0, nothing to test
            cell.update({f"{m}_verdict": "reference" for m in STAT_METRICS})
            cell.update({f"{m}_delta": 0.0 for m in STAT_METRICS})
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
            "n_pairs": len(_seeds(runs, model, mode) & _seeds(runs, model, stats.REFERENCE_MODE)),
            **cell, **_pair_corr(runs, model, mode),
            **{c: _mean_of(g, c) for c in ("flushed_activation", "subnormal_activation", "flushed_param",
                                           "subnormal_param", "flushed_adapter", "subnormal_adapter")},
            **_below_normal(g),
            **{c: _mean_of(g, c) for c in ("tokens_per_backward", "loss_divisor", "regime_tokens_per_step", "n_val",
                                           "val_loss_uniform", "val_loss_unigram")},
            "confidence": cfg["confidence"],
            **trajectory.summary_columns(g, cfg["confidence"]),
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
    table["top1_delta_vs_fp32"] = table.get("top1_delta", np.nan)  # the column's older name, kept for its readers
    table["error_rate"] = verdicts.error_rate_line(table, cfg["confidence"])
    for col in SUMMARY_COLUMNS:
        if col not in table:
            table[col] = np.nan
    return table[SUMMARY_COLUMNS + [c for c in trajectory.COLUMNS if c in table]]


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
    """`Δ ± half width` of one metric: the 95% interval, or the 90% one TOST decides on where the verdict is
    equivalent (marked so); bold when the difference survives the table's multiplicity control; `ref` on FP32."""
    if r["mode"] == stats.REFERENCE_MODE:
        return "ref"
    d = r[f"{name}_delta"]
    if pd.isna(d):
        return "—"
    verdict = r.get(f"{name}_verdict", "")
    equiv = verdict == "equivalent"
    ci = r.get(f"{name}_ci90" if equiv else f"{name}_delta_ci", np.nan)
    cell = f"{_fmt(scale * d, digits)}" + ("" if pd.isna(ci) else f" ± {_fmt(scale * ci, digits)}") \
        + (" (90%)" if equiv and not pd.isna(ci) else "")
    return f"**{cell}**" if verdict in ("cost", "gain") else cell


def _overflow_cell(r) -> str:
    """`initial descent + in training` overflow steps per run (the total alone when the runs predate the split)."""
    if pd.isna(r.get("overflow_initial", np.nan)):
        return _fmt(r["overflow_steps"], 1)
    return f"{_fmt(r['overflow_initial'], 1)} + {_fmt(r['overflow_in_training'], 1)}"


def _pct_cell(v) -> str:
    return "—" if v is None or pd.isna(v) else f"{100 * v:.1f}"


def _rate_cell(r) -> str:
    """In-training overflow steps per 1000 steps (pooled over seeds) and its exact Poisson interval."""
    rate, low, high = (r.get(k, np.nan) for k in ("overflow_per_1k", "overflow_per_1k_low", "overflow_per_1k_high"))
    return _fmt(rate, 2) if pd.isna(high) else f"{_fmt(rate, 2)} ({_fmt(low, 2)}–{_fmt(high, 2)})"


def _verdict_cell(r, name: str) -> str:
    """The verdict, with the reason where the cell cannot decide and the seeds a declared effect would need."""
    v = r.get(f"{name}_verdict", "")
    if not isinstance(v, str) or not v:  # no FP32 run of the family to compare with
        return "—"
    note, seeds = r.get(f"{name}_note", ""), r.get(f"{name}_seeds_needed", "")
    if v == "not resolved" and isinstance(note, str) and note and r.get(f"{name}_spread") not in ("pooled", "own"):
        return f"{v} ({note})"
    if v == "not resolved" and isinstance(seeds, str) and seeds:
        own = ", on its own spread" if r.get(f"{name}_spread") == "own" else ""
        return f"{v} (seeds for the declared effect: {seeds}{own})"
    return v


def _row_cells(r, fp32_top1: float) -> list[str]:
    return [r["model"], r["mode"], _fmt(100 * fp32_top1, 1),
            f"{_fmt(100 * r['top1_mean'], 1)} ± {_fmt(100 * r['top1_std'], 1)}",
            _delta_cell(r, "top1", 100, 1), _fmt(r["val_loss_mean"], 3), _delta_cell(r, "val_loss", 1, 3),
            _fmt(r["final_train_loss"], 3), _pct_cell(r.get("flushed_activation")),
            _pct_cell(r.get("subnormal_activation")), _overflow_cell(r), _rate_cell(r),
            _fmt(r["growth_attempts"], 1),
            _verdict_cell(r, "top1"), _verdict_cell(r, "val_loss"), _fmt(r["top1_pair_corr"], 2),
            _fmt(r["val_loss_pair_corr"], 2), _fmt(int(r["n_pairs"])), _fmt(r["skipped_pct"], 1),
            _fmt(r["update_ratio"], 3), _fmt(r["final_scale"], 0),
            _fmt(r["throughput"], 0), speed_cell(r["speedup_vs_fp32"], r.get("fp16_path")), _fmt(r["peak_memory_mb"], 0),
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
    conf = cfg["confidence"]
    compared = table[table["mode"] != stats.REFERENCE_MODE]
    pairs = ", ".join(sorted({str(int(n)) for n in compared["n_pairs"]})) or "none"
    margins = "; ".join(
        f"{model} ±{100 * g['top1_margin'].iloc[0]:.2g} pp top-1, ±{g['val_loss_margin'].iloc[0]:.3g} nats"
        for model, g in compared.groupby("model", sort=False)
        if "top1_margin" in g and pd.notna(g["top1_margin"].iloc[0]))
    return [
        f"Δ: the mean over seeds of (mode − FP32) on the same seed and the same validation examples (top-1 in "
        f"percentage points, validation loss in nats), ± the half width of its {100 * conf:g}% interval; n pairs "
        f"per row: {pairs}. The interval counts both sources of variance: the seeds, whose spread is pooled over "
        "the family's modes (a two-way model of mode and seed effects) unless a mode's own spread is far larger "
        "(then its own), and the validation examples (images; the LM's documents), which another draw of the "
        "test set would change (lab/study/inference.py, docs/statistics.md).",
        verdicts.error_rate_line(table, conf) + " **Bold**: a cost or gain that survives it.",
        "Verdicts: cost / gain: the difference is resolved and not shown to lie inside the margin; negligible: "
        "resolved, and inside the margin; equivalent: TOST puts it inside the margin (shown with the 90% interval "
        "it decides on); not resolved: neither, with the reason or the paired seeds a declared effect of interest "
        "would need at 80% power (at the pooled spread – its upper 90% bound), sized at the level the verdict "
        "needs: Benjamini–Hochberg's first step, 5% over the table's difference tests (more than 1000: a number "
        "exists beyond that; none suffices: the validation set's own noise is larger than the effect); identical: "
        "the same evaluation, bit for bit (every example's correctness and loss), on every seed. A spread of zero "
        "decides nothing. Diverged runs count: their non-finite losses as a "
        f"uniform guess (ln C). Margins (declared in configs/claims.yaml before the runs): "
        f"{margins or 'the study config'}.",
        "Pair r: Pearson r of FP32 and mode values across seeds (— under 3 pairs).",
    ]


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
              f"in-training overflow /1k steps ({100 * cfg['confidence']:g}% exact)", "growth attempts",
              "top-1 verdict", "val-loss verdict", "pair r top-1", "pair r val loss", "n pairs", "skipped %",
              "update ratio",
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
        "steps after the first clean step, pooled over seeds, with its exact (Garwood) Poisson interval; growth "
        "attempts count the steps at which the policy raised the scale. "
        "Act. grads flushed / subnormal: of the activation-gradient values FP32 holds non-zero, the share FP16 "
        "flushes to zero / keeps only as subnormals, over every census step: an FP16 run's FP32 replay at the "
        "scale it used, an FP32 run's counterfactual at scale 1 (FP16 without a loss scale). "
        "Speedup vs FP32: samples/s against the family's FP32 runs on this device; marked (emulated) where the "
        f"reduced precision ran as {FP16_PATH_CONTRACT} (software on a CPU): the emulation's cost, in runs that "
        "shared the machine, not the precision's speed (docs/throughput.md). "
        "Peak memory on CPU "
        "is the process's peak RSS; activation MB is what autograd saved for backward in one step.",
    ]
    regime = _regime_line(table)
    if regime:
        notes.append(regime)
    notes += adapter_lines(table)
    same = identical_lines(identical)
    return "\n".join(lines + notes + ([""] + same if same else []) + planted_lines(runs)) + "\n"


def _below_normal(g: pd.DataFrame) -> dict:
    """Per run, flushed + subnormal (the values FP16 keeps below its smallest normal, at the scale the census
    measured); the mean and sd over the row's seeds (claims' `share` kind)."""
    out = {}
    for source in ("adapter", "activation"):
        cols = [f"flushed_{source}", f"subnormal_{source}"]
        if not all(c in g for c in cols):
            out.update({f"below_normal_{source}": np.nan, f"below_normal_{source}_sd": np.nan})
            continue
        per_run = pd.to_numeric(g[cols[0]], errors="coerce") + pd.to_numeric(g[cols[1]], errors="coerce")
        per_run = per_run.dropna()
        out[f"below_normal_{source}"] = per_run.mean() if len(per_run) else np.nan
        out[f"below_normal_{source}_sd"] = per_run.std(ddof=1) if len(per_run) > 1 else np.nan
    return out


def adapter_lines(table: pd.DataFrame) -> list[str]:
    """LoRA fine-tunes: the adapters' gradients, flushed / kept only as subnormals (as the activation columns)."""
    if "flushed_adapter" not in table or table["flushed_adapter"].isna().all():
        return []
    rows = table[table["flushed_adapter"].notna()]
    cells = "; ".join(f"{r['model']} {r['mode']} {_pct_cell(r['flushed_adapter'])} / "
                      f"{_pct_cell(r['subnormal_adapter'])}" for _, r in rows.iterrows())
    return ["", "LoRA adapters' gradients flushed % / subnormal % (of the values FP32 holds non-zero; the same "
            f"census as the activation columns): {cells}."]


FINDINGS_MARKERS = ("<!-- findings:start -->", "<!-- findings:end -->")
#: the modes the findings table shows, in this order, when the summary has them
FINDINGS_MODES = ("fp16-noscale", "fp16-static128", "fp16-static1024", "fp16-dynamic", "bf16", "fp16-hysteresis",
                  "fp16-deepspeed", "fp16-amax", "fp16-gradnorm", "fp16-warmup", "fp16-dynamic-fallback")
_SHORT = {"cost": "**cost**", "gain": "**gain**", "equivalent": "equiv.", "negligible": "negl.",
          "not resolved": "n.r.", "identical": "identical"}


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
            equiv = r["val_loss_verdict"] == "equivalent"
            hw = r["val_loss_ci90"] if equiv else r["val_loss_delta_ci"]
            ci = "" if pd.isna(hw) else f" ± {hw:.3f}"
            cells.append(f"{r['val_loss_delta']:+.3f}{ci} {_SHORT.get(r['val_loss_verdict'], r['val_loss_verdict'])}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    rate = table["error_rate"].dropna().iloc[0] if "error_rate" in table and table["error_rate"].notna().any() \
        else ""
    return "\n".join(lines + ["", "Validation loss of each mode minus FP32 on the same seeds and examples (nats) ± "
                               "the half width of its 95% interval (90% where equivalent: what TOST decides on); "
                               "**cost** / **gain**: resolved, not shown inside the margin; negl.: resolved but "
                               "inside it; equiv.: inside it; n.r.: not resolved. " + rate + " Generated from "
                               "results/tables/summary.csv by `make claims`; method: docs/statistics.md."]) + "\n"


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


def aggregate(run_dirs, csv_path, md_path, stats_cfg: dict | None = None, declared: dict | None = None,
              trajectory_spec: dict | None = None, runs_csv=None) -> pd.DataFrame:
    """Write summary.csv and summary.md; `stats_cfg` is the study's `stats:` block (defaults when None), `declared`
    the margins and effects of interest per family (configs/claims.yaml `declared:`; None: the stats block's),
    `trajectory_spec` the claims file's `trajectory:` block (settled overflows, time to target; None: no such
    columns), `runs_csv` where to write the per-run table too (lab/study/runs_table.py: what per-run claims read;
    None: not written)."""
    run_dirs = list(run_dirs)
    metrics = load_runs(run_dirs)
    per_run = runs_table(metrics) if runs_csv is not None else None
    runs = trajectory.add_run_values(metrics, run_dirs, trajectory_spec)
    table = summarize(runs, stats_cfg, verdicts.read_outcomes(run_dirs), declared)
    # every file read (steps.csv for the identical modes too) before either table is written: a damaged one
    # (lab.core.runfiles.RunFileError) leaves neither
    md = to_markdown(table, stats_cfg, identical_groups(run_dirs, runs, table), runs)
    if trajectory_spec is not None:
        md += "\n" + trajectory.to_markdown(table, trajectory_spec, stats_config(stats_cfg)["confidence"])
    files.atomic_write_text(csv_path, table.to_csv(index=False))
    files.atomic_write_text(md_path, md)
    if per_run is not None:
        files.atomic_write_text(runs_csv, per_run.to_csv(index=False, lineterminator="\n"))
    return table

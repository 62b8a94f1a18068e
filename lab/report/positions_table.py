"""The long-context study's tables and figure (configs/long-context.yaml; `python -m lab positions-table`): every run's
positions.csv (train.position_probe, lab/numerics/positions.py) gathered by context and mode.

* positions.csv: one row per (model, context, mode, tensor, path, bin): the positions cut into BINS equal parts of
  the sequence, pooled over the bin's positions and the seeds exactly (sums of squares and counts), so contexts
  compare at the same relative position;
* positions.md: one row per (model, mode): the tail's and the head's numbers (means over seeds of each run's
  ``tail_head``), and for a run trained with gradient checkpointing whether its positions.csv and metrics equal,
  byte for byte, those of the run with the same settings and seed trained without it;
* the figure: FP16's relative error of the residual stream's gradient, the share of the attention's FP16 gradients
  held as subnormals, and the attention output's error by accumulation path, against the relative position.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import files
from lab.core.runfiles import read_csv_frame, read_json, read_text, read_yaml
from lab.numerics import positions

BINS = 16
#: metrics.json fields that differ between two runs of the same computation (times, memory, the config's hash)
NOT_COMPUTED = ("wall_s", "train_time_s", "throughput_samples_per_s", "config_hash", "mode", "peak_memory_mb",
                "activation_mb", "memory_kind", "peak_memory_covers")
#: the md table's columns: (heading, tensor, path, stat, where)
SHOWN = [("FP16 stream err, tail", "stream", "fp16", "rel_err", "tail"),
         ("FP16 stream err, head", "stream", "fp16", "rel_err", "head"),
         ("FP32 stream err, tail", "stream", "fp32", "rel_err", "tail"),
         ("FP16 qkv subnormal, tail", "qkv", "fp16", "subnormal", "tail"),
         ("FP16 qkv subnormal, head", "qkv", "fp16", "subnormal", "head"),
         ("FP16 qkv flushed, tail", "qkv", "fp16", "flushed", "tail"),
         ("attn contract err, tail", "attn_out", "contract", "rel_err", "tail"),
         ("attn probs16 err, tail", "attn_out", "probs16", "rel_err", "tail"),
         ("attn accum16 err, tail", "attn_out", "accum16", "rel_err", "tail"),
         ("attn accum16 err, head", "attn_out", "accum16", "rel_err", "head")]


def _run_dirs(sources) -> list[Path]:
    """Run folders (those with metrics.json and positions.csv) under each source, in order."""
    out = []
    for s in map(Path, sources):
        found = [s] if (s / "metrics.json").is_file() else sorted(p.parent for p in s.rglob("metrics.json"))
        out += [p for p in found if (p / positions.FILE).is_file()]
    return out


def _identity(run: Path) -> tuple:
    """What a run computes, but for its mode's name and whether it checkpointed: its model, seed and settings."""
    cfg = read_yaml(run / "config.yaml")
    cfg["mode"].pop("name", None)
    cfg["train"].pop("gradient_checkpointing", None)
    return json.dumps(cfg, sort_keys=True, default=str)


def _computed(run: Path) -> str:
    """Digest of positions.csv and of metrics.json without the fields two runs of one computation differ in."""
    m = {k: v for k, v in read_json(run / "metrics.json").items() if k not in NOT_COMPUTED
         and not k.startswith("peak_memory")}
    return hashlib.sha256((read_text(run / positions.FILE) + json.dumps(m, sort_keys=True)).encode()).hexdigest()


def load(sources) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-run scalars, per-position rows): one row per run with model, mode, seed, context, checkpointing, the
    run's tail_head scalars and ``same_as_unchecked`` (for a checkpointed run: True when the run of the same
    settings and seed without checkpointing computed the same positions.csv and metrics; NaN when there is none)."""
    runs, rows, ident = [], [], {}
    for run in _run_dirs(sources):
        m, cfg = read_json(run / "metrics.json"), read_yaml(run / "config.yaml")
        table = read_csv_frame(run / positions.FILE)
        ckpt = bool(cfg["train"].get("gradient_checkpointing", False))
        info = {"model": m["model"], "mode": m["mode"], "seed": int(m["seed"]), "context": int(m["context"]),
                "checkpointing": ckpt, "run": str(run)}
        runs.append({**info, **positions.tail_head(table)})
        rows.append(table.assign(**{k: info[k] for k in ("model", "mode", "seed", "context")}))
        ident.setdefault(_identity(run), {})[ckpt] = _computed(run)
    per_run = pd.DataFrame(runs)
    if per_run.empty:
        return per_run, pd.DataFrame()
    per_run["same_as_unchecked"] = [
        (ident[_identity(Path(r))].get(False) == ident[_identity(Path(r))][True]
         if False in ident[_identity(Path(r))] else math.nan) if c else math.nan
        for r, c in zip(per_run["run"], per_run["checkpointing"])]
    return per_run, pd.concat(rows, ignore_index=True)


def binned(rows: pd.DataFrame, bins: int = BINS) -> pd.DataFrame:
    """positions.csv's rows pooled into ``bins`` equal parts of each sequence and over the seeds."""
    r = rows.assign(bin=(rows["position"] * bins // rows["context"]).astype(int),
                    err2=rows["err_norm"] ** 2, ref2=rows["ref_norm"] ** 2)
    keys = ["model", "context", "mode", "tensor", "path", "bin"]
    s = r.groupby(keys, sort=False)[["err2", "ref2", "n", "nonzero", "flushed", "subnormal", "overflow"]].sum()
    seeds = r.groupby(keys, sort=False)["seed"].nunique()
    out = pd.DataFrame({"rel_position": (s.index.get_level_values("bin") + 0.5) / bins,
                        "rel_err": np.sqrt(s["err2"] / s["ref2"]), "ref_rms": np.sqrt(s["ref2"] / s["n"]),
                        "flushed": s["flushed"] / s["nonzero"].clip(lower=1), "subnormal": s["subnormal"] / s["n"],
                        "overflow": s["overflow"] / s["n"], "seeds": seeds}).reset_index()
    return out.sort_values(["context", "mode", "tensor", "path", "bin"], kind="stable").reset_index(drop=True)


def summary(per_run: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, mode): context, seeds, the SHOWN numbers (means over seeds) and the checkpointing check."""
    out = []
    for (model, mode), g in per_run.groupby(["model", "mode"], sort=False):
        row = {"model": model, "context": int(g["context"].iloc[0]), "mode": mode, "seeds": len(g)}
        for heading, tensor, path, stat, where in SHOWN:
            col = f"pos_{tensor}_{path}_{stat}_{where}"
            row[heading] = float(g[col].mean()) if col in g else math.nan
        same = g["same_as_unchecked"].dropna()
        row["same as unchecked"] = (f"{int(same.sum())} of {len(same)} seeds" if len(same) else "")
        out.append(row)
    return pd.DataFrame(out).sort_values(["context", "mode"], kind="stable").reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    head = ["context", "mode", "seeds", *[h for h, *_ in SHOWN], "same as unchecked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in table.iterrows():
        cells = [str(r["context"]), r["mode"], str(r["seeds"])]
        cells += [f"{r[h]:.3g}" if math.isfinite(r[h]) else "—" for h, *_ in SHOWN]
        cells.append(r["same as unchecked"] or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return ("# Gradients by position, FP16 and FP32 against FP64\n\n" + "\n".join(lines) + "\n\n"
            "Each run's final model on its first validation batch (the training batch size; lab/numerics/positions.py), "
            "means over seeds. Tail: the last quarter of the positions, head: the first. stream: the gradient of the "
            "residual stream entering the first block, its relative error ||g/S - g64|| / ||g64|| pooled over the "
            "positions (FP16 at the run's final scale S; an FP32 run's FP16 column is FP16 at scale 1, the "
            "counterfactual); qkv: every attention's query/key/value gradient (FP16 tensors), the share held as a "
            "subnormal and the share of FP64's non-zero values flushed to zero; attn: each attention's output on the "
            "FP16 operands against FP64 by path: contract (the lab's: FP32 softmax and sums, one rounding), probs16 "
            "(probabilities rounded to FP16 before P @ V, as a GPU flash kernel), accum16 (every sum in FP16, in "
            "order). same as unchecked: a run trained with gradient checkpointing whose positions.csv and metrics "
            "(times and memory aside) equal byte for byte those of the same settings and seed without it. Generated "
            "by `python -m lab positions-table`.\n")


def figure(bins: pd.DataFrame, path, mode: str = "fp16-dynamic") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    b = bins[bins["mode"] == mode]
    panels = [("stream", "fp16", "rel_err", "FP16 residual-stream gradient: rel. error vs FP64", "relative error"),
              ("qkv", "fp16", "subnormal", "FP16 attention gradients (q, k, v): share subnormal",
               "share of values subnormal"),
              ("attn_out", None, "rel_err", "attention output: rel. error vs FP64 (solid accum16, dashed contract)",
               "relative error")]
    fig, axes = plt.subplots(1, 3, figsize=(15.5, 4.2))
    contexts = sorted(b["context"].unique())
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(contexts)))
    for ax, (tensor, path_, stat, title, ylabel) in zip(axes, panels):
        for c, colour in zip(contexts, colours):
            here = b[(b["context"] == c) & (b["tensor"] == tensor)]
            for p, style in ((("accum16", "-"), ("contract", "--")) if path_ is None else ((path_, "-"),)):
                h = here[here["path"] == p]
                ax.plot(h["rel_position"], h[stat], style, color=colour, label=f"{c}" if style == "-" else None)
        ax.set_yscale("log")
        ax.set_xlabel("position / context")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
    # the contexts' legend beside the panels: inside the first it covered its lines
    fig.legend(*axes[0].get_legend_handles_labels(), title="context", fontsize=8, loc="center right")
    fig.suptitle(f"{mode}: final models, one validation batch, pooled over seeds")
    fig.tight_layout(rect=(0, 0, 0.95, 1))
    files.atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")
    plt.close(fig)
    return Path(path)


def write(sources, csv, md, figure_path=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    per_run, rows = load(sources)
    if per_run.empty:
        raise FileNotFoundError(f"no run with {positions.FILE} under {', '.join(map(str, sources))}")
    bins, table = binned(rows), summary(per_run)
    files.atomic_write_text(csv, bins.to_csv(index=False))
    files.atomic_write_text(md, markdown(table))
    if figure_path:
        figure(bins, figure_path)
    return bins, table

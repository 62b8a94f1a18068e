"""Two policies side by side on the same seeds: what one buys over the other (``python -m lab compare``).

For each family both modes ran, per metric: each side's mean over seeds and their difference (left − right on the
same seed), decided by the study's procedure (lab/study/inference.py). Skipped and overflow steps are counts: an
exact conditional Poisson test of the two modes' counts summed over seeds with their steps as exposure (no
interval from 0–5 events per run, and none of zero width). The shares of the gradients FP16 flushed at the scale
used (the census's FP32 replay: flushed_param, flushed_activation) and the validation loss get the interval of
the summary: the seed spread pooled over the family's modes (here against `right` instead of FP32), plus the
validation examples' own variance for the loss. Benjamini–Hochberg across the table's tests controls its false
discovery rate at 1 − confidence; bold marks what survives. `make claims` puts the table into the README.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.study import inference, verdicts

__all__ = ["COMPARED", "compare_modes", "comparison_markdown", "COMPARE_MARKERS"]

#: metric -> (label, digits, scale for display)
COMPARED = {"skipped_steps": ("skipped steps", 1, 1.0), "overflow_steps": ("overflow steps", 1, 1.0),
            "flushed_param": ("flushed param. grads (pp)", 3, 100.0),
            "flushed_activation": ("flushed act. grads (pp)", 3, 100.0),
            "final_val_loss": ("val loss (nats)", 3, 1.0)}
COUNTS = ("skipped_steps", "overflow_steps")
COMPARE_MARKERS = ("<!-- compare:start -->", "<!-- compare:end -->")


def _by_seed(g: pd.DataFrame, field: str) -> dict:
    v = pd.to_numeric(g[field], errors="coerce") if field in g else pd.Series(np.nan, index=g.index)
    return {s: float(x) for s, x in zip(g["seed"], v) if math.isfinite(x)}


def _count_row(fam: pd.DataFrame, metric: str, left: str, right: str) -> dict | None:
    a, b = (_by_seed(fam[fam["mode"] == m], metric) for m in (left, right))
    # exposure: each run's steps (runs without a step count: one unit per run)
    sa, sb = ((_by_seed(fam[fam["mode"] == m], "steps") if "steps" in fam else dict.fromkeys(a if m == left else b,
                                                                                          1.0))
              for m in (left, right))
    seeds = sorted(set(a) & set(b) & set(sa) & set(sb))
    if not seeds:
        return None
    ca, cb = sum(a[s] for s in seeds), sum(b[s] for s in seeds)
    ea, eb = sum(sa[s] for s in seeds), sum(sb[s] for s in seeds)
    res = inference.poisson_compare(ca, ea, cb, eb)
    p = min(1.0, 2 * min(res["p_larger"], res["p_smaller"])) if math.isfinite(res["p_larger"]) else math.nan
    return {"n_pairs": len(seeds), "left_mean": ca / len(seeds), "right_mean": cb / len(seeds),
            "delta": (ca - cb) / len(seeds), "delta_ci": math.nan, "p": p, "method": "exact Poisson",
            "spread": "counts"}


def _continuous_row(fam: pd.DataFrame, metric: str, left: str, right: str, outs: list | None,
                    confidence: float) -> dict | None:
    rows = fam.to_dict("records")
    if metric == "final_val_loss":
        values, units = verdicts.family_inputs(rows, outs or [None] * len(rows), "val_loss", right)
    else:
        values, units = {}, {}
        for r in rows:
            v = float(pd.to_numeric(r.get(metric), errors="coerce"))
            if math.isfinite(v):
                values.setdefault(r["mode"], {})[r["seed"]] = v
    if left not in values or right not in values:
        return None
    cell = inference.family_cells(values, units, right, math.nan).get(left)
    if cell is None or cell.n_pairs == 0:
        return None
    seeds = sorted(set(values[left]) & set(values[right]))
    return {"n_pairs": cell.n_pairs, "left_mean": float(np.mean([values[left][s] for s in seeds])),
            "right_mean": float(np.mean([values[right][s] for s in seeds])), "delta": cell.delta,
            "delta_ci": cell.half_width(confidence) if cell.decidable else math.nan, "p": cell.p_diff,
            "method": "pooled t" + (" + examples" if cell.n_units else ""), "spread": cell.spread,
            "note": cell.note}


def compare_modes(runs: pd.DataFrame, left: str, right: str, confidence: float = 0.95,
                  outcomes: list | None = None) -> pd.DataFrame:
    """One row per (family, metric) where both modes ran on a shared seed: n, the sides' means, Δ (left − right),
    its half width (NaN for counts), p, q (Benjamini–Hochberg over the table) and resolved (q ≤ 1 − confidence).
    ``outcomes``: each run's outcomes.npz (row order of ``runs``), for the validation loss's example variance."""
    rows = []
    runs = runs.reset_index(drop=True)
    outs = outcomes if outcomes is not None else [None] * len(runs)
    for model in dict.fromkeys(runs["model"]):
        idx = runs.index[runs["model"] == model]
        fam = runs.loc[idx]
        fam_outs = [outs[i] for i in idx]
        for metric in COMPARED:
            r = (_count_row(fam, metric, left, right) if metric in COUNTS
                 else _continuous_row(fam, metric, left, right, fam_outs, confidence))
            if r is not None:
                rows.append({"model": model, "metric": metric, "left": left, "right": right, **r,
                             "confidence": confidence})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["q"] = inference.bh_adjust(table["p"].to_numpy(float))
    table["resolved"] = table["q"] <= 1 - confidence
    return table


def comparison_markdown(table: pd.DataFrame) -> str:
    """Families as columns, metrics as rows: "left / right, Δ (± half width)" (bold when it survives BH)."""
    if table.empty:
        return "No family has runs of both modes on a shared seed.\n"
    left, right = table["left"].iloc[0], table["right"].iloc[0]
    families = list(dict.fromkeys(table["model"]))
    by = table.set_index(["model", "metric"])
    lines = [f"| {left} − {right} | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    for metric, (label, digits, scale) in COMPARED.items():
        cells = []
        for f in families:
            if (f, metric) not in by.index:
                cells.append("—")
                continue
            r = by.loc[(f, metric)]
            ci = "" if not math.isfinite(r["delta_ci"]) else f" ± {scale * r['delta_ci']:.{digits}f}"
            d = f"{scale * r['delta']:+.{digits}f}{ci}"
            if metric in COUNTS and math.isfinite(r["q"]):
                d += f" (q {r['q']:.2g})"
            cells.append(f"{scale * r['left_mean']:.{digits}f} / {scale * r['right_mean']:.{digits}f}, "
                         + (f"**{d}**" if r["resolved"] else d))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    pairs = "/".join(map(str, sorted(set(table["n_pairs"]))))
    conf = table["confidence"].iloc[0]
    tests = int(table["p"].notna().sum())
    note = (f"Each cell: {left} / {right} (means over seeds; {pairs} seeds), then their difference on the same "
            f"seed. Skipped and overflow steps: an exact Poisson test of the counts summed over seeds, the steps as "
            f"exposure (q: its Benjamini–Hochberg q-value); the rest: ± the half width of the {100 * conf:g}% "
            "interval from the family's pooled seed spread (and, for the loss, the validation examples). Error rate: "
            f"false discovery rate {1 - conf:.0%} (Benjamini–Hochberg) across this table's {tests} tests; bold: what "
            "survives it. Flushed: of the gradient values FP32 holds non-zero, the share FP16 flushed at the scale "
            "the run used (census steps). Generated by `python -m lab compare`.")
    return "\n".join(lines + ["", note]) + "\n"

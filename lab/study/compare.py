"""Two policies side by side on the same seeds: what one buys over the other (``python -m lab compare``).

For each family both modes ran, per metric: each side's mean over seeds and their difference (left − right on the
same seed), decided by the study's procedure (lab/study/inference.py). Overflows are counted once, as the events
they are (a skipping policy's skipped steps are the same steps), and split: the initial descent (the deterministic
halvings from the initial scale down to the first clean step) is shown but not tested, it is a rule's arithmetic,
not a rate; overflows in training (after the first clean step) are tested: an exact conditional Poisson test of the
two modes' counts summed over seeds with their steps after the first clean step as exposure, once the counts pass a
check of overdispersion across seeds (Pearson's χ² of each mode's per-seed counts against its pooled rate; an
overdispersed count is not tested: the Poisson test would understate its spread). The shares of the gradients FP16
flushed at the scale used (the census's FP32 replay: flushed_param, flushed_activation) and the validation loss get
the interval of the summary: the seed spread pooled over the family's modes (here against `right` instead of FP32),
plus the validation examples' own variance for the loss. Benjamini–Hochberg across the table's tests controls its
false discovery rate at 1 − confidence; bold marks what survives. `make claims` puts the table into the README.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.study import inference, verdicts

__all__ = ["COMPARED", "compare_modes", "comparison_markdown", "COMPARE_MARKERS"]

#: metric -> (label, digits, scale for display)
COMPARED = {"overflow_initial": ("overflows, initial descent (not tested)", 1, 1.0),
            "overflow_in_training": ("overflows in training", 1, 1.0),
            "flushed_param": ("flushed param. grads (pp)", 3, 100.0),
            "flushed_activation": ("flushed act. grads (pp)", 3, 100.0),
            "final_val_loss": ("val loss (nats)", 3, 1.0)}
COUNTS = ("overflow_initial", "overflow_in_training")
#: the count each is tested against, as exposure: the steps after the first clean step (None: not tested)
EXPOSURE = {"overflow_initial": None, "overflow_in_training": "steps_after_first_clean"}
#: Pearson's χ² of the per-seed counts at or below this p: overdispersed, not tested as Poisson
OVERDISPERSION_LEVEL = 0.05
COMPARE_MARKERS = ("<!-- compare:start -->", "<!-- compare:end -->")


def _by_seed(g: pd.DataFrame, field: str) -> dict:
    v = pd.to_numeric(g[field], errors="coerce") if field in g else pd.Series(np.nan, index=g.index)
    return {s: float(x) for s, x in zip(g["seed"], v) if math.isfinite(x)}


def _count_row(fam: pd.DataFrame, metric: str, left: str, right: str) -> dict | None:
    a, b = (_by_seed(fam[fam["mode"] == m], metric) for m in (left, right))
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    ca, cb = sum(a[s] for s in seeds), sum(b[s] for s in seeds)
    row = {"n_pairs": len(seeds), "left_mean": ca / len(seeds), "right_mean": cb / len(seeds),
           "delta": (ca - cb) / len(seeds), "delta_ci": math.nan, "p": math.nan, "method": "not tested",
           "spread": "counts", "note": ""}
    exposure = EXPOSURE[metric]
    if exposure is None:
        row["note"] = "the initial descent: the rule's halvings from its initial scale, not a rate"
        return row
    # exposure: each run's steps after its first clean step (runs without it: one unit per run)
    ea_by, eb_by = ((_by_seed(fam[fam["mode"] == m], exposure) if exposure in fam else dict.fromkeys(seeds, 1.0))
                    for m in (left, right))
    seeds = [s for s in seeds if ea_by.get(s, 0) > 0 and eb_by.get(s, 0) > 0]
    if not seeds:
        return row
    over = {m: _overdispersion([c[s] for s in seeds], [e[s] for s in seeds])
            for m, c, e in ((left, a, ea_by), (right, b, eb_by))}
    bad = {m: p for m, p in over.items() if p <= OVERDISPERSION_LEVEL}
    row["overdispersion_p"] = min(over.values())
    if bad:
        row["note"] = "overdispersed across seeds (" + ", ".join(f"{m}: Pearson χ² p {p:.2g}" for m, p in bad.items()) \
            + "): not tested as Poisson"
        return row
    ca, cb = sum(a[s] for s in seeds), sum(b[s] for s in seeds)
    res = inference.poisson_compare(ca, sum(ea_by[s] for s in seeds), cb, sum(eb_by[s] for s in seeds))
    row["p"] = min(1.0, 2 * min(res["p_larger"], res["p_smaller"])) if math.isfinite(res["p_larger"]) else math.nan
    row["method"] = "exact Poisson"
    return row


def _overdispersion(counts: list[float], exposures: list[float]) -> float:
    """p of Pearson's χ² (S − 1 df) of per-seed counts against one rate for all seeds; 1 with < 2 seeds or no event."""
    total, expo = sum(counts), sum(exposures)
    if len(counts) < 2 or total == 0:
        return 1.0
    expected = [total * e / expo for e in exposures]
    chi2 = sum((c - x) ** 2 / x for c, x in zip(counts, expected))
    from scipy import stats as st
    return float(st.chi2.sf(chi2, len(counts) - 1))


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
            elif metric in COUNTS and "overdispersed" in str(r.get("note", "")):
                d += " (overdispersed: not tested)"
            cells.append(f"{scale * r['left_mean']:.{digits}f} / {scale * r['right_mean']:.{digits}f}, "
                         + (f"**{d}**" if r["resolved"] else d))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    pairs = "/".join(map(str, sorted(set(table["n_pairs"]))))
    conf = table["confidence"].iloc[0]
    tests = int(table["p"].notna().sum())
    note = (f"Each cell: {left} / {right} (means over seeds; {pairs} seeds), then their difference on the same "
            "seed. Overflow steps, counted once (a skipping policy skips exactly these steps): the initial descent "
            "from the initial scale is the rule's arithmetic, shown, not tested; overflows in training: an exact "
            "Poisson test of the counts summed over seeds, the steps after the first clean step as exposure, where "
            "the per-seed counts are not overdispersed (Pearson χ²) (q: its Benjamini–Hochberg q-value); the rest: "
            f"± the half width of the {100 * conf:g}% "
            "interval from the family's pooled seed spread (and, for the loss, the validation examples). Error rate: "
            f"false discovery rate {1 - conf:.0%} (Benjamini–Hochberg) across this table's {tests} tests; bold: what "
            "survives it. Flushed: of the gradient values FP32 holds non-zero, the share FP16 flushed at the scale "
            "the run used (census steps). Generated by `python -m lab compare`.")
    return "\n".join(lines + ["", note]) + "\n"

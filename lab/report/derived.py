"""Derived views of a study's results: the small computations figures, the report and notebooks share.

Each takes frames from the loaders of lab.report.load (load_metrics, load_steps, load_census, load_hist) and returns a
table or a value: FP16's limits, the fraction of values lost at a loss scale, per-layer underflow, where
overflow steps start, top-1 per mode, per-run counters and loss-scale events, which run to look at first.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd

from lab.core.kernel_paths import speed_cell
from lab.report.load import ID_COLUMNS, mode_order, model_order

TOTAL_LAYER = "__total__"
SOURCES = ("activation_grad", "param_grad")
COUNTERFACTUAL_SCALES = (1.0, 128.0, 1024.0, 65536.0)


def fp16_limits() -> dict:
    """FP16's range: smallest subnormal (2^-24), smallest normal (2^-14), largest (65504), and the rounding bounds
    of an FP32 -> FP16 cast (round to nearest even, as lab.numerics.census classifies): |v| <= underflow_bound
    (2^-25) becomes 0, |v| >= overflow_bound (65520) becomes inf. lab.core.fp16's formulas on numpy's finfo of
    the same IEEE format, so that drawing them needs no torch (tests/test_numerics.py: equal to torch.finfo's)."""
    import numpy

    from lab.core.fp16_range import bounds
    b = bounds(numpy.finfo(numpy.float16))
    out = {"smallest_subnormal": b["SMALLEST_SUBNORMAL"], "smallest_normal": b["SMALLEST_NORMAL"],
           "max": b["MAX"], "underflow_bound": b["UNDERFLOW_BOUND"], "overflow_bound": b["OVERFLOW_BOUND"]}
    out.update({f"log2_{k}": math.log2(v) for k, v in list(out.items())})
    return out


def reference_runs(metrics_or_frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of FP32 runs (precision fp32, else mode named fp32)."""
    df = metrics_or_frame
    if df.empty:
        return df
    if "precision" in df and df["precision"].notna().any():
        ref = df[df["precision"] == "fp32"]
        if not ref.empty:
            return ref
    return df[df["mode"] == "fp32"]


def fp32_hist(hist: pd.DataFrame, model: str) -> pd.DataFrame:
    """The gradient histogram of one FP32 run of `model` (lowest seed), unscaled (the at_scale-1 rows if present)."""
    h = hist[hist["model"] == model] if len(hist) else hist
    h = reference_runs(h)
    if h.empty:
        return h
    h = h[h["seed"] == h["seed"].min()]
    smallest = h["at_scale"].min()
    return h[h["at_scale"] == smallest]


def hist_distribution(hist: pd.DataFrame) -> pd.DataFrame:
    """Per source: fraction of all values in each unscaled log2 bin (and the zero / nonfinite fractions),
    summed over every step the histogram holds. Columns source, kind, k_unscaled, count, fraction."""
    if hist.empty:
        return pd.DataFrame(columns=["source", "kind", "k_unscaled", "count", "fraction"])
    h = hist.copy()
    h["k_unscaled"] = h["k_unscaled"].fillna(np.inf)  # the special bins, kept apart by kind
    g = h.groupby(["source", "kind", "k_unscaled"], as_index=False)["count"].sum()
    g["fraction"] = g["count"] / g.groupby("source")["count"].transform("sum")
    g.loc[g["kind"] != "value", "k_unscaled"] = np.nan
    return g.sort_values(["source", "kind", "k_unscaled"]).reset_index(drop=True)


def lost_at_scale_from_hist(dist: pd.DataFrame, scale: float, limits: dict | None = None) -> dict:
    """Fraction of a source's non-zero values lost in FP16 at a loss scale, from an unscaled log2 histogram.

    A bin [2^k, 2^(k+1)) is lost to underflow when all of it, scaled, rounds to zero (upper edge <= 2^-25,
    half the smallest subnormal), and to overflow when all of it rounds to inf (lower edge >= 65520); bins
    straddling a bound count as kept, so for bin-aligned scales (powers of two) this is exact but for the
    bins at the very ends. Non-finite values count as overflow. `dist` is one source's rows of
    hist_distribution.
    """
    limits = limits or fp16_limits()
    v = dist[dist["kind"] == "value"]
    nonfinite = dist.loc[dist["kind"] == "nonfinite", "count"].sum()
    nonzero = v["count"].sum() + nonfinite
    if nonzero == 0:
        return {"underflow": float("nan"), "overflow": float("nan"), "lost": float("nan")}
    upper = np.exp2(v["k_unscaled"] + 1) * scale
    lower = np.exp2(v["k_unscaled"]) * scale
    under = v.loc[upper <= limits["underflow_bound"], "count"].sum()
    over = v.loc[lower >= limits["overflow_bound"], "count"].sum() + nonfinite
    u, o = under / nonzero, over / nonzero
    return {"underflow": float(u), "overflow": float(o), "lost": float(u + o)}


def lost_fractions(model: str, census: pd.DataFrame, hist: pd.DataFrame,
                   scales: Iterable[float] = COUNTERFACTUAL_SCALES) -> pd.DataFrame:
    """Per source and scale: fraction of an FP32 run's non-zero gradient values FP16 would lose.

    From the census's counterfactual `__total__` rows where it has them (exact classification), else
    estimated from the gradient histogram. Columns source, at_scale, underflow, overflow, lost, method.
    """
    rows = []
    c = reference_runs(census[census["model"] == model]) if len(census) else census
    if len(c):
        c = c[(c["layer"] == TOTAL_LAYER) & (c["seed"] == c["seed"].min())]
    dist = hist_distribution(fp32_hist(hist, model)) if len(hist) else hist_distribution(hist)
    sources = list(dict.fromkeys([*(c["source"].unique() if len(c) else []), *dist["source"].unique()]))
    for source in sorted(sources, key=lambda s: (s not in SOURCES, SOURCES.index(s) if s in SOURCES else 0, s)):
        for s in scales:
            sel = c[(c["source"] == source) & np.isclose(c["at_scale"], s)] if len(c) else c
            if len(sel):
                nonzero = (sel["total"] - sel["zero"]).sum()
                u = sel["underflow"].sum() / nonzero if nonzero else float("nan")
                o = sel["overflow"].sum() / nonzero if nonzero else float("nan")
                rows.append(dict(source=source, at_scale=float(s), underflow=u, overflow=o, lost=u + o,
                                 method="census"))
            elif len(dist[dist["source"] == source]):
                r = lost_at_scale_from_hist(dist[dist["source"] == source], s)
                rows.append(dict(source=source, at_scale=float(s), **r, method="histogram"))
    return pd.DataFrame(rows, columns=["source", "at_scale", "underflow", "overflow", "lost", "method"])


def _as_used(c: pd.DataFrame) -> pd.DataFrame:
    """What FP16 lost at the scale each run used. An FP32 run: its counterfactual rows at every scale. A
    reduced-precision run: the FP32 replay of its census steps (census.csv grads "fp32": exact gradients,
    classified as FP16 at the scale in use would hold them) where it has one, else its own rows, where a
    flushed value is already an exact zero and "underflow" counts only values on the boundary; steps counted
    at several scales (after an FP32 fallback) are dropped."""
    n_scales = c.groupby(["run_dir", "step", "grads"])["at_scale"].transform("nunique")
    fp32_run = c["precision"] == "fp32"
    replayed = c["run_dir"].map(c[(c["grads"] == "fp32") & ~fp32_run & (n_scales == 1)]
                                .groupby("run_dir").size()).fillna(0) > 0
    own = c["grads"] == c["precision"]
    keep = fp32_run | ((n_scales == 1) & np.where(replayed, c["grads"] == "fp32", own))
    return c[keep].copy()


def census_column_label(mode: str, precision: str | None, at_scale: float) -> str:
    if precision == "fp32" or mode == "fp32":
        return f"{mode} ×{at_scale:g}"
    return mode


def underflow_by_layer(census: pd.DataFrame, model: str, source: str) -> pd.DataFrame:
    """Layers x columns of underflow fraction (underflow / all values, summed over steps and seeds).

    Columns: an FP32 run's counterfactual scales ("fp32 ×128", ...) then each reduced-precision mode at the
    scale it used. Rows in the order the census lists layers (forward order); `__total__` last.
    """
    c = census[(census["model"] == model) & (census["source"] == source)] if len(census) else census
    if c.empty:
        return pd.DataFrame()
    c = _as_used(c)
    # a label per (mode, precision, scale), given to its rows: a model's census has tens of thousands of rows, and
    # a label made row by row took most of this function's time
    group = c.groupby(["mode", "precision", "at_scale"], sort=False, dropna=False).ngroup().to_numpy()
    _, first = np.unique(group, return_index=True)  # each group's first row, group by group
    labels = c.iloc[first]
    labels = labels.assign(column=[census_column_label(m, p, s)
                                   for m, p, s in zip(labels["mode"], labels["precision"], labels["at_scale"])])
    c["column"] = labels["column"].to_numpy()[group]
    g = c.groupby(["layer", "column"], sort=False)[["underflow", "total"]].sum()
    frac = (g["underflow"] / g["total"].where(g["total"] > 0)).unstack("column")
    labels = labels.iloc[np.argsort(first, kind="stable")]  # in the order the rows have them
    cols = []
    for m in mode_order(labels["mode"].unique()):
        cols.extend(dict.fromkeys(labels.loc[labels["mode"] == m].sort_values("at_scale", kind="stable")["column"]))
    return frac.reindex(index=_layer_order(c, frac), columns=[x for x in cols if x in frac.columns])


OVERFLOW_PHASES = ("initial descent", "in training")  # the same split as metrics.json and summary.csv
NOT_RECORDED = "(not recorded)"


def overflow_origins(steps: pd.DataFrame, model: str) -> pd.DataFrame:
    """Where a model's overflow steps start: columns phase, origin, mode, steps (overflow steps summed over
    seeds), most frequent origins first.

    origin: steps.csv's first_nonfinite_layer and first_nonfinite_source, "layer (source)" (activation_grad:
    the gradient at the layer's output; param_grad: its weights), or "(not recorded)". phase: "initial descent"
    for overflow steps before a run's first clean step (the initial scale still too high), "in training" after.
    """
    cols = ["phase", "origin", "mode", "steps"]
    s = steps[(steps["model"] == model) & (steps["found_inf"].astype(int) == 1)] if len(steps) else steps
    if s.empty:
        return pd.DataFrame(columns=cols)
    s = s.copy()
    first_clean = steps[(steps["model"] == model) & (steps["found_inf"].astype(int) == 0)] \
        .groupby("run_dir")["step"].min()
    s["phase"] = np.where(s["step"] < s["run_dir"].map(first_clean).fillna(np.inf), *OVERFLOW_PHASES)
    layer = s.get("first_nonfinite_layer", pd.Series("", index=s.index)).fillna("").astype(str)
    source = s.get("first_nonfinite_source", pd.Series("", index=s.index)).fillna("").astype(str)
    s["origin"] = [(f"{l} ({src})" if src else l) if l else NOT_RECORDED for l, src in zip(layer, source)]
    g = s.groupby(["phase", "origin", "mode"]).size().rename("steps").reset_index()
    total = g.groupby("origin")["steps"].sum()
    modes = {m: i for i, m in enumerate(mode_order(g["mode"].unique()))}
    g = g.assign(_t=-g["origin"].map(total), _m=g["mode"].map(modes),
                 _p=g["phase"].map({p: i for i, p in enumerate(OVERFLOW_PHASES)}))
    return g.sort_values(["_p", "_t", "origin", "_m"]).drop(columns=["_t", "_m", "_p"]).reset_index(drop=True)[cols]


def _layer_order(c: pd.DataFrame, frac: pd.DataFrame) -> list[str]:
    layers = [l for l in c["layer"].unique() if l != TOTAL_LAYER]  # in order of appearance
    return layers + ([TOTAL_LAYER] if TOTAL_LAYER in frac.index else [])


def underflow_over_steps(census: pd.DataFrame, model: str, mode: str, source: str, seed: int | None = None,
                         at_scale: float | None = None) -> pd.DataFrame:
    """Layers x census steps of underflow fraction for one run (lowest seed unless given). An FP32 run's
    rows are counterfactual: `at_scale` picks the scale (default the smallest, i.e. unscaled)."""
    c = census[(census["model"] == model) & (census["mode"] == mode) & (census["source"] == source)] \
        if len(census) else census
    if c.empty:
        return pd.DataFrame()
    seed = c["seed"].min() if seed is None else seed
    c = _as_used(c[c["seed"] == seed])
    if c["precision"].eq("fp32").any() or mode == "fp32":
        at_scale = c["at_scale"].min() if at_scale is None else at_scale
        c = c[np.isclose(c["at_scale"], at_scale)]
    g = c.groupby(["layer", "step"], sort=False)[["underflow", "total"]].sum()
    frac = (g["underflow"] / g["total"].where(g["total"] > 0)).unstack("step")
    return frac.reindex(index=_layer_order(c, frac), columns=sorted(frac.columns))


LOSS_COLUMNS = ("flushed_activation", "subnormal_activation", "flushed_param", "subnormal_param")


def fp16_loss_by_mode(metrics: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per mode, mean over seeds: of the gradient values FP32 holds non-zero, the shares FP16 flushes to zero
    and keeps only as subnormals (metrics.json flushed_* / subnormal_*: an FP16 run's FP32 replay at the scale
    it used; an FP32 run's counterfactual at scale 1), with the validation loss beside them."""
    m = metrics[metrics["model"] == model] if len(metrics) else metrics
    cols = [c for c in (*LOSS_COLUMNS, "final_val_loss") if c in m]
    if m.empty or not cols:
        return pd.DataFrame(columns=["mode", *LOSS_COLUMNS, "final_val_loss"])
    g = m.groupby("mode", sort=False)[cols].agg(lambda v: pd.to_numeric(v, errors="coerce").mean())
    return g.reindex(mode_order(g.index)).reset_index()


def top1_by_mode(metrics: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per mode: mean and sample std over seeds of final validation top-1, n seeds, and the seeds' values."""
    m = metrics[metrics["model"] == model]
    if m.empty:
        return pd.DataFrame(columns=["mode", "mean", "std", "n", "values"])
    rows = []
    for mode in mode_order(m["mode"].unique()):
        v = m.loc[m["mode"] == mode, "final_top1"].astype(float)
        rows.append({"mode": mode, "mean": v.mean(), "std": v.std(ddof=1) if len(v) > 1 else 0.0, "n": len(v),
                     "values": v.tolist()})
    return pd.DataFrame(rows)


def models_in(*frames: pd.DataFrame) -> list[str]:
    """Model families present in any of the frames (model_order)."""
    seen: dict[str, None] = {}
    for f in frames:
        if len(f) and "model" in f:
            seen.update(dict.fromkeys(f["model"]))
    return model_order(seen)


def run_counters(steps: pd.DataFrame) -> pd.DataFrame:
    """Per run, where its counters ended: steps, skipped steps, update ratio, first/last/min/max loss scale."""
    if steps.empty:
        return pd.DataFrame(columns=ID_COLUMNS + ["steps", "skipped", "update_ratio", "first_scale",
                                                  "final_scale", "min_scale", "max_scale"])
    g = steps.groupby(ID_COLUMNS, sort=False)
    out = pd.DataFrame({
        "steps": g["step"].count(), "skipped": g["skip_count"].last(), "update_ratio": g["update_ratio"].last(),
        "first_scale": g["scale"].first(), "final_scale": g["scale"].last(),
        "min_scale": g["scale"].min(), "max_scale": g["scale"].max(),
    }).reset_index()
    return out


def scale_events(steps: pd.DataFrame, model: str, mode: str, seed: int | None = None) -> pd.DataFrame:
    """One run's steps where something happened to the loss scale: a skipped step, or the scale changed
    after the step (next_scale). Lowest seed unless given."""
    s = steps[(steps["model"] == model) & (steps["mode"] == mode)]
    if s.empty:
        return pd.DataFrame(columns=["step", "scale", "next_scale", "skipped", "found_inf", "grad_norm", "loss"])
    s = s[s["seed"] == (s["seed"].min() if seed is None else seed)].sort_values("step")
    s = s.assign(next_scale=s["scale"].shift(-1))
    ev = s[(s["skipped"].astype(bool)) | (s["next_scale"].notna() & (s["next_scale"] != s["scale"]))]
    return ev[["step", "scale", "next_scale", "skipped", "found_inf", "grad_norm", "loss"]].reset_index(drop=True)


def most_eventful_run(metrics: pd.DataFrame, model: str | None = None) -> tuple[str, str] | None:
    """(model, mode) of the FP16 mode with the most skipped steps (ties: the default mode order), to look
    at first; None without FP16 runs."""
    m = metrics if model is None else metrics[metrics["model"] == model]
    m = m[m["precision"] == "fp16"] if len(m) and "precision" in m else m.iloc[0:0]
    if m.empty:
        return None
    per = m.groupby(["model", "mode"], sort=False)["skipped_steps"].mean().reset_index()
    order = {md: i for i, md in enumerate(mode_order(per["mode"]))}
    per["rank"] = per["mode"].map(order)
    best = per.sort_values(["skipped_steps", "rank"], ascending=[False, True]).iloc[0]
    return str(best["model"]), str(best["mode"])


def pick_run(metrics: pd.DataFrame, model: str | None = None, mode: str | None = None) -> tuple[str, str]:
    """(model, mode) to look at: the ones given, else the FP16 mode with the most skipped steps, else the
    first run's."""
    if model is not None and mode is not None:
        return model, mode
    if mode is not None:
        return (model or str(metrics.loc[metrics["mode"] == mode, "model"].iloc[0])), mode
    best = most_eventful_run(metrics, model)
    if best:
        return best
    m = metrics if model is None else metrics[metrics["model"] == model]
    if m.empty:
        raise ValueError(f"no finished runs{' of ' + model if model else ''}")
    return str(m["model"].iloc[0]), str(m["mode"].iloc[0])


#: verdict words as the README's tables show them (lab/study/aggregate.py findings_markdown)
VERDICT_SHORT = {"cost": "cost", "gain": "gain", "equivalent": "equiv.", "negligible": "negl.",
                 "not resolved": "n.r.", "identical": "identical", "reference": ""}


def _number(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _delta_cell(row, metric: str, factor: float, digits: int) -> str:
    """'+0.009 ± 0.076 n.r.': the paired Δ against FP32 ± the half width of its interval (the 90% one where the
    verdict is equivalent: what TOST decides on) and the verdict, as the README's findings table writes it; '—'
    without a Δ, 'reference' for FP32 itself."""
    verdict = str(row.get(f"{metric}_verdict", "") or "")
    if verdict == "reference":
        return "reference"
    delta = _number(row.get(f"{metric}_delta"))
    if not math.isfinite(delta):
        return "—"
    hw = _number(row.get(f"{metric}_ci90" if verdict == "equivalent" else f"{metric}_delta_ci"))
    ci = f" ± {factor * hw:.{digits}f}" if math.isfinite(hw) else " (no interval)"
    word = VERDICT_SHORT.get(verdict, verdict)
    return f"{factor * delta:+.{digits}f}{ci}" + (f" {word}" if word else "")


def _scale_cell(v) -> str:
    v = _number(v)
    if not math.isfinite(v) or v <= 0:
        return "—"
    exp = math.log2(v)
    return f"2^{exp:.0f}" if abs(exp - round(exp)) < 1e-9 else f"2^{exp:.2f}"


def overview_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The study overview's summary for a reader (notebooks/01_study_overview.ipynb): per model and mode, top-1 in
    % (mean ± std over seeds), top-1 and validation-loss Δ against FP32 with their intervals and verdicts (pp, nats),
    overflow steps per run (the initial descent + in training), skipped steps %, final scale as a power of two,
    speed against FP32: strings, never raw floats (5.555556e-03 is -0.56 pp of top-1 here)."""
    def pct(v, digits=1):
        v = _number(v)
        return f"{100 * v:.{digits}f}" if math.isfinite(v) else "—"

    rows = []
    for _, r in summary.iterrows():
        mean, sd = _number(r.get("top1_mean")), _number(r.get("top1_std"))
        top1 = f"{pct(mean)} ± {pct(sd)}" if math.isfinite(sd) else pct(mean)
        descent, during = _number(r.get("overflow_initial")), _number(r.get("overflow_in_training"))
        overflow = f"{descent:.1f} + {during:.1f}" if math.isfinite(descent) and math.isfinite(during) else "—"
        speed, skipped = _number(r.get("speedup_vs_fp32")), _number(r.get("skipped_pct"))  # skipped_pct: in %
        skipped = f"{skipped:.2f}" if math.isfinite(skipped) else "—"
        rows.append({"model": r["model"], "mode": r["mode"], "seeds": f"{_number(r.get('n_seeds')):.0f}",
                     "top-1 %": top1, "Δ top-1 (pp)": _delta_cell(r, "top1", 100.0, 2),
                     "val loss (nats)": (f"{_number(r.get('val_loss_mean')):.3f}"
                                         if math.isfinite(_number(r.get("val_loss_mean"))) else "—"),
                     "Δ val loss (nats)": _delta_cell(r, "val_loss", 1.0, 3),
                     "overflow steps (descent + training)": overflow, "skipped %": skipped,
                     "final scale": _scale_cell(r.get("final_scale")),
                     "speed vs FP32 (this device)": speed_cell(speed, r.get("fp16_path"))})
    return pd.DataFrame(rows)


def runs_overview(metrics: pd.DataFrame) -> pd.DataFrame:
    """The overview's runs, one row per finished run, for a reader: top-1 in %, counts as whole numbers, the final
    scale as a power of two (load_metrics' frame; a results folder without runs gives the empty table)."""
    m = metrics.reindex(columns=["model", "mode", "seed", "status", "final_top1", "steps", "skipped_steps",
                                 "overflow_steps", "final_scale"])
    out = pd.DataFrame({"model": m["model"], "mode": m["mode"], "seed": m["seed"], "status": m["status"]})
    out["top-1 %"] = [f"{100 * v:.1f}" if math.isfinite(_number(v)) else "—" for v in m["final_top1"]]
    for col in ("steps", "skipped_steps", "overflow_steps"):
        out[col.replace("_", " ")] = [f"{_number(v):.0f}" if math.isfinite(_number(v)) else "—" for v in m[col]]
    out["final scale"] = [_scale_cell(v) for v in m["final_scale"]]
    return out

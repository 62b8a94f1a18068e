"""The study's figures, one function per figure: each returns a matplotlib Figure and, given `out`, saves it.

Figures are built with the object-oriented API, each on its own Agg canvas (no pyplot state, no display
needed, whatever the global backend), so they render the same headless in a Snakemake job and inline in a
notebook (`%matplotlib inline`; a Figure as a cell's last value is shown). Data comes from lab.report.load,
the tables drawn from lab.report.derived.

Per model, under results/figures/<model>/ (`write_all`, or `python -m lab figures`):
  scale.png      loss scale over steps for every FP16 mode (log2 axis, skipped steps marked)
  loss.png       training loss over steps for every mode
  grad_hist.png  an FP32 run's log2 gradient magnitudes against FP16's subnormal/normal/max boundaries,
                 with the fraction of values lost at scales 1, 128, 1024, 65536 (Micikevicius et al. 2018)
  top1.png       final validation top-1 per mode, mean ± std over seeds, each seed a dot
  underflow.png  per-layer underflow fraction, layers x modes (FP32 counterfactual scales first)
  overflow.png   where overflow steps start (first non-finite gradient), in the initial descent and in training
  modes/<mode>.png  one mode's runs seed by seed: loss scale, training loss, gradient norm
A figure whose data a run set lacks (no census yet, no FP32 run) is still written, holding a note that says
what is missing, so the file set never depends on the data.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from lab.core import files
from lab.report import derived as D, load as R

DPI = 110
ROW_LABEL_PT = 7  # a heatmap's layer labels; ROW_INCHES a row leaves them 3 points between
ROW_INCHES = 10 / 72
HEATMAP_NOTE = "underflowing values / all values (log colour; < 1e-5 darkest, grey: no data)"
SOURCE_TITLES = {"activation_grad": "activation gradients", "param_grad": "weight gradients",
                 "adapter_grad": "LoRA adapter gradients"}


# --- helpers ------------------------------------------------------------------------------------------------
def new_figure(width: float = 8.0, height: float = 4.5, layout: str | None = "constrained",
               dpi: float | None = None) -> Figure:
    fig = Figure(figsize=(width, height), layout=layout, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write a PNG atomically (temporary file + rename): a reader never sees half a figure.

    The figure is laid out once, at the file's dpi, then drawn once: savefig with a layout engine would draw it
    twice (a pass that draws nothing, to run the layout, then the real one). The figure keeps its dpi and layout
    engine afterwards. One without a layout engine (the heatmaps, _place_heatmaps) is drawn as laid out: make it
    at DPI to save it."""
    path = Path(path)
    engine, dpi = fig.get_layout_engine(), fig.dpi
    try:
        # laid out at the dpi it is drawn at: the text sizes measured are then the ones drawn (and cached)
        fig.set_dpi(DPI)
        if engine is not None and fig.axes:
            engine.execute(fig)
            fig.set_layout_engine(None)
        # lab.core.files.atomic_write: a temporary file renamed over the target, with the umask's mode
        files.atomic_write(path, lambda f: fig.savefig(f, dpi=DPI, format="png"), mode="wb")
    finally:
        fig.set_dpi(dpi)
        if fig.get_layout_engine() is not engine:
            fig.set_layout_engine(engine)
    return path


def _done(fig: Figure, out) -> Figure:
    if out is not None:
        save(fig, out)
    return fig


def note_figure(title: str, message: str, out=None) -> Figure:
    """A placeholder saying why a figure has no data (so the file exists and says so)."""
    fig = new_figure(7, 2.6)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=10, transform=ax.transAxes)
    return _done(fig, out)


def mode_colors(modes) -> dict:
    """One colour per mode, the same in every figure of a study (modes in lab.report.load.mode_order)."""
    modes = R.mode_order(modes)
    cmap = matplotlib.colormaps["tab10" if len(modes) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(modes)}


def _pow2_axis(ax, values=None):
    """log2 y axis labelled 2^k, a tick on every power of two (every second one beyond 16 of them)."""
    ax.set_yscale("log", base=2)
    v = np.asarray(values if values is not None else [], dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v):
        lo, hi = math.floor(math.log2(v.min())) - 1, math.ceil(math.log2(v.max())) + 1
        ax.set_ylim(2.0 ** lo, 2.0 ** hi)
        step = 1 if hi - lo <= 16 else 2
        ax.yaxis.set_major_locator(FixedLocator([2.0 ** k for k in range(lo, hi + 1, step)]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"$2^{{{int(round(math.log2(v)))}}}$" if v > 0 else "0"))
    ax.yaxis.set_minor_locator(NullLocator())


def _seed_style(seed_rank: int) -> dict:
    return {"linestyle": ["-", "--", ":", "-."][seed_rank % 4], "alpha": 1.0 if seed_rank == 0 else 0.6}


def _fp16_modes(steps: pd.DataFrame) -> list[str]:
    fp16 = steps.groupby("mode")["precision"].agg(lambda p: (p == "fp16").any())
    return R.mode_order(fp16[fp16].index)


def _smooth(y: pd.Series, n: int) -> pd.Series:
    window = max(1, n // 30)
    return y.rolling(window, min_periods=1, center=True).mean() if window > 1 else y


# --- figures ------------------------------------------------------------------------------------------------
def scale_figure(steps: pd.DataFrame, model: str, out=None, planted=()) -> Figure:
    """Loss scale at every step for every FP16 mode of `model` (log2 axis); x marks skipped steps, dotted
    lines the steps where faults were planted (`planted`: train.faults, lab/run/faults.py)."""
    s = steps[steps["model"] == model] if len(steps) else steps
    title = f"{model}: loss scale per step"
    if s.empty or not _fp16_modes(s):
        return note_figure(title, "no FP16 runs with steps.csv for this model", out)
    colors = mode_colors(s["mode"].unique())
    fig = new_figure(9, 4.8)
    ax = fig.add_subplot()
    modes = _fp16_modes(s)
    for i, mode in enumerate(modes):
        lw = 1.3 + 2.2 * (len(modes) - 1 - i) / max(1, len(modes) - 1)  # earlier modes wider: overlaps stay visible
        for rank, (seed, r) in enumerate(s[s["mode"] == mode].groupby("seed")):
            style = _seed_style(rank)
            ax.step(r["step"], r["scale"], where="post", color=colors[mode], lw=lw,
                    label=mode if rank == 0 else None, **style)
            sk = r[r["skipped"].astype(bool)]
            if len(sk):
                ax.plot(sk["step"], sk["scale"], "x", color=colors[mode], ms=6, mew=1.5, alpha=style["alpha"])
    ax.plot([], [], "x", color="k", label="skipped step (inf/nan)")
    for i, step in enumerate(sorted(planted)):
        ax.axvline(step, color="0.35", ls=":", lw=1.2, label="planted fault" if i == 0 else None, gid="planted")
    _pow2_axis(ax, s.loc[s["mode"].isin(_fp16_modes(s)), "scale"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale used")
    ax.set_title(title + (" (seed 0 solid, further seeds dashed)" if s["seed"].nunique() > 1 else ""))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return _done(fig, out)


def loss_figure(steps: pd.DataFrame, model: str, out=None) -> Figure:
    """Training loss per step for every mode of `model`: mean over seeds, lightly smoothed; non-finite marked."""
    s = steps[steps["model"] == model] if len(steps) else steps
    title = f"{model}: training loss"
    if s.empty:
        return note_figure(title, "no steps.csv for this model", out)
    colors = mode_colors(s["mode"].unique())
    fig = new_figure(9, 4.8)
    ax = fig.add_subplot()
    bad_any = False
    for mode in R.mode_order(s["mode"].unique()):
        r = s[s["mode"] == mode]
        finite = r[np.isfinite(r["loss"])]
        mean = finite.groupby("step")["loss"].mean()
        if len(mean):
            ax.plot(mean.index, _smooth(mean, len(mean)), color=colors[mode], lw=1.4,
                    label=f"{mode} ({r['seed'].nunique()} seed{'s' * (r['seed'].nunique() > 1)})")
        bad = r[~np.isfinite(r["loss"])]
        if len(bad):
            bad_any = True
            ax.plot(bad["step"], np.full(len(bad), 1.0), "v", color=colors[mode], ms=5,
                    transform=ax.get_xaxis_transform(), clip_on=False)
    if bad_any:
        ax.plot([], [], "v", color="k", label="non-finite loss")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over seeds, smoothed)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return _done(fig, out)


def _fp16_range_marks(ax, lim: dict, lo: float, hi: float):
    """Shade what FP16 flushes to zero, holds only as subnormals or cannot hold; mark its limits; and, dotted,
    where each loss scale moves the underflow limit in unscaled terms."""
    ax.axvspan(lo, lim["log2_smallest_subnormal"], color="#d62728", alpha=0.08, lw=0)
    ax.axvspan(lim["log2_smallest_subnormal"], lim["log2_smallest_normal"], color="#ff7f0e", alpha=0.08, lw=0)
    ax.axvspan(lim["log2_max"], hi, color="#d62728", alpha=0.08, lw=0)
    for key, name, color in (("log2_smallest_subnormal", "smallest subnormal", "#d62728"),
                             ("log2_smallest_normal", "smallest normal", "#ff7f0e"),
                             ("log2_max", "max", "#d62728")):
        x = lim[key]
        value = lim[key.replace("log2_", "")]
        ax.axvline(x, color=color, lw=1.5, gid=f"fp16_{key.replace('log2_', '')}")
        right = key == "log2_max"
        ax.text(x, 0.98, f"FP16 {name} \n{value:.6g}" + (f" = $2^{{{x:g}}}$" if x == int(x) else "") + " ",
                transform=ax.get_xaxis_transform(), va="top", ha="right" if right else "left",
                multialignment="right" if right else "left", fontsize=7, color=color)
    for s in D.COUNTERFACTUAL_SCALES[1:]:
        x = lim["log2_smallest_subnormal"] - math.log2(s)
        ax.axvline(x, color="0.4", lw=0.8, ls=":", gid=f"underflow_limit_at_scale_{s:g}")
        ax.text(x, 0.02, f"×{s:g}", transform=ax.get_xaxis_transform(), fontsize=7, color="0.3",
                ha="right", rotation=90, va="bottom")


def _lost_text(dist: pd.DataFrame, lost: pd.DataFrame) -> str:
    """The text box of a grad_hist panel: exact zeros, and what FP16 loses at each scale (one source's rows of
    hist_distribution and lost_fractions)."""
    zero = dist.loc[dist["kind"] == "zero", "fraction"].sum()
    nonfinite = dist.loc[dist["kind"] == "nonfinite", "fraction"].sum()
    lines = [f"exact zeros: {100 * zero:.1f}% of values"
             + (f", non-finite {100 * nonfinite:.2g}%" if nonfinite else "")]
    if len(lost):
        lines.append("lost in FP16 (of non-zero values):")
        for _, r in lost.iterrows():
            lines.append(f"  scale {r['at_scale']:>6g}: {100 * r['lost']:6.2f}%  "
                         f"(under {100 * r['underflow']:.2f}%, over {100 * r['overflow']:.2f}%)")
        lines.append(f"  [{', '.join(sorted(set(lost['method'])))}]")
    return "\n".join(lines)


def _grad_hist_panel(ax, dist: pd.DataFrame, lost: pd.DataFrame, lim: dict):
    """One gradient source's panel: its histogram, FP16's range over it, the fractions lost."""
    v = dist[dist["kind"] == "value"]
    ax.bar(v["k_unscaled"], 100 * v["fraction"], width=1.0, align="edge", color="#4c72b0",
           edgecolor="white", lw=0.3, label="FP32 gradient values")
    lo = min(v["k_unscaled"].min() if len(v) else -40, lim["log2_smallest_subnormal"] - 17) - 1
    hi = max(v["k_unscaled"].max() + 1 if len(v) else 0, lim["log2_max"]) + 2
    ax.set_xlim(lo, hi)
    _fp16_range_marks(ax, lim, lo, hi)
    ax.set_ylim(0, 1.3 * 100 * v["fraction"].max() if len(v) else 1)
    ax.text(0.86, 0.80, _lost_text(dist, lost), transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
            multialignment="left", family="monospace", bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9),
            gid="lost_text")
    ax.set_ylabel("% of values")
    ax.set_xlabel("log2 |gradient| (bin k: [2^k, 2^(k+1)))")


def grad_hist_figure(hist: pd.DataFrame, census: pd.DataFrame, model: str, out=None) -> Figure:
    """Histogram of log2 |gradient| of an FP32 run, FP16's limits (from torch.finfo) drawn over it, and the
    fraction of non-zero values FP16 loses (underflow + overflow) at loss scales 1, 128, 1024, 65536."""
    title = f"{model}: FP32 gradient magnitudes vs FP16's range"
    h = D.fp32_hist(hist, model) if len(hist) else hist
    if h.empty:
        why = "no grad_hist.csv in this model's FP32 runs" if not len(hist) or model not in set(hist["model"]) \
            else "no FP32 run of this model has grad_hist.csv"
        return note_figure(title, why + " (runs from before the gradient census have none)", out)
    lim = D.fp16_limits()
    dist = D.hist_distribution(h)
    lost = D.lost_fractions(model, census, hist)
    sources = sorted(dist["source"].unique(), key=lambda x: (x not in D.SOURCES, x))
    fig = new_figure(10, 3.6 * len(sources) + 0.6)
    axes = fig.subplots(len(sources), 1, squeeze=False)[:, 0]
    for ax, source in zip(axes, sources):
        _grad_hist_panel(ax, dist[dist["source"] == source], lost[lost["source"] == source], lim)
        steps_used = h.loc[h["source"] == source, "step"].nunique()
        ax.set_title(f"{SOURCE_TITLES.get(source, source)} ({steps_used} step{'s' * (steps_used != 1)}, "
                     f"seed {h['seed'].min()})", fontsize=10)
    fig.suptitle(title)
    return _done(fig, out)


def top1_figure(metrics: pd.DataFrame, model: str, out=None) -> Figure:
    """Final validation top-1 per mode: bar = mean over seeds, error bar = sample std, dots = seeds."""
    title = f"{model}: validation top-1"
    t = D.top1_by_mode(metrics, model) if len(metrics) else pd.DataFrame()
    if t.empty:
        return note_figure(title, "no finished runs (metrics.json) for this model", out)
    colors = mode_colors(t["mode"])
    m = metrics[metrics["model"] == model]
    fig = new_figure(max(6.0, 0.75 * len(t) + 2), 4.6)
    ax = fig.add_subplot()
    x = np.arange(len(t))
    ax.bar(x, 100 * t["mean"], color=[colors[mo] for mo in t["mode"]], alpha=0.75,
           yerr=100 * t["std"], capsize=4, error_kw=dict(lw=1.2))
    for i, (mode, vals) in enumerate(zip(t["mode"], t["values"])):
        jitter = np.linspace(-0.15, 0.15, len(vals)) if len(vals) > 1 else [0.0]
        ax.plot(i + np.asarray(jitter), 100 * np.asarray(vals), "o", color="k", ms=3.5, zorder=3)
        div = m[(m["mode"] == mode)]
        n_div = int(div["diverged"].astype(bool).sum()) if "diverged" in div else 0
        label = f"n={len(vals)}" + (f"\n{n_div} diverged" if n_div else "")
        ax.text(i, 1.0, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7,
                color="#d62728" if n_div else "0.3")
    fp32 = t[t["mode"] == "fp32"]
    if len(fp32):
        ax.axhline(100 * fp32["mean"].iloc[0], color="k", ls="--", lw=1, label="FP32 mean")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xticks(x, t["mode"], rotation=35, ha="right", fontsize=8)
    vals = np.concatenate([np.asarray(v, float) for v in t["values"]]) * 100
    low = max(0.0, np.nanmin(vals) - 5) if np.isfinite(vals).any() else 0
    ax.set_ylim(low, min(100.0, max(np.nanmax(vals) + 3, low + 5)) if np.isfinite(vals).any() else 100)
    ax.set_ylabel("final validation top-1 (%)")
    ax.set_title(title + " (mean ± std over seeds)", pad=18)
    ax.grid(True, axis="y", alpha=0.3)
    return _done(fig, out)


def _heatmap(ax, table: pd.DataFrame, fig: Figure, floor: float = 1e-5):
    """Draw `table` on `ax`, its colorbar on an axes of its own; returns that axes (see _place_heatmaps)."""
    vals = table.to_numpy(dtype=float)
    shown = np.where(np.isnan(vals), np.nan, np.clip(vals, floor, 1.0))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap=cmap, norm=LogNorm(floor, 1.0),
                   interpolation="nearest")
    # one size for every depth: the figure grows ROW_INCHES a layer instead (a 90-layer MobileNet-v2 shrank
    # its labels to 5 points when the size fell with the layer count)
    ax.set_yticks(range(len(table.index)), table.index, fontsize=ROW_LABEL_PT)
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns], rotation=40, ha="right", fontsize=7)
    if vals.size <= 400:
        for (i, j), v in np.ndenumerate(vals):
            if np.isfinite(v) and v > 0:
                ax.text(j, i, f"{v:.0e}" if v < 0.01 else f"{v:.2f}", ha="center", va="center", fontsize=5.5,
                        color="white" if v < 0.05 else "black")
    cax = fig.add_axes((0.9, 0.1, 0.03, 0.64))  # placed by _place_heatmaps
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("underflow fraction", fontsize=8)
    return cax


def _place_heatmaps(fig: Figure, panels: list[tuple], suptitle=None) -> None:
    """Lay out heatmaps side by side, each (heatmap axes, its colorbar's axes), as constrained layout laid them
    out: 3-point pads, 2% of the width between panels, each colorbar 5% of its heatmap's width to its right, 1/20
    as wide as tall, at most 80% of the heatmap's height and 15% of its width; the heatmaps equally sized, as
    large as their labels and titles leave room for. The figure keeps no layout engine.

    One measurement of each panel's labels does: a heatmap's ticks are fixed, so what surrounds it does not
    depend on its size. Constrained layout measured each tick label about ten times per figure drawn (two passes,
    then a draw that draws nothing before the real one): with a label per layer, a third to a half of the time a
    heatmap took. Measured at the figure's dpi, so draw it at that dpi (underflow_figure and
    underflow_steps_figure make the figure at DPI when they save it)."""
    renderer = fig.canvas.get_renderer()
    fw, fh = fig.bbox.width, fig.bbox.height  # pixels, like every extent below
    pad = 3 * fig.dpi / 72
    title_pad = matplotlib.rcParams["axes.titlepad"] * fig.dpi / 72
    left, right, bottom, top = [], [], [], []
    # small text hinted at another dpi is a few percent wider or narrower: a 5-point label 7% wider at 110 than 100
    for ax, cax in panels:
        box, cbox = ax.get_window_extent(), cax.get_window_extent()
        xb, yb = ax.xaxis.get_tightbbox(renderer), ax.yaxis.get_tightbbox(renderer)
        title = ax.title.get_window_extent(renderer).height + title_pad if ax.get_title() else 0.0
        left.append(box.x0 - min(xb.x0, yb.x0) + pad)  # y labels, or the first rotated x label
        right.append(cax.yaxis.get_tightbbox(renderer).x1 - cbox.x1 + pad)  # its tick labels and label
        bottom.append(box.y0 - min(xb.y0, yb.y0) + pad)
        top.append(max(title, yb.y1 - box.y1, xb.y1 - box.y1) + pad)
    head = 0.0
    if suptitle is not None:
        suptitle.set_y(1 - pad / fh)  # its top, pad below the figure's edge (va="top")
        head = suptitle.get_window_extent(renderer).height + 2 * pad
    y0 = max(bottom)
    height = max(fh - head - max(top) - y0, 0.1 * fh)
    n, gap = len(panels), 0.02 * fw
    room = fw - (n - 1) * gap - sum(left) - sum(right)
    cb_width = 0.8 * height / 20
    width = (room - n * cb_width) / (1.05 * n)
    if cb_width > 0.15 * width:  # a narrow heatmap: its colorbar 15% of its width, and shorter
        width = room / (1.2 * n)
        cb_width = 0.15 * width
    width = max(width, 0.1 * fw)
    x = 0.0
    for (ax, cax), lft, rgt in zip(panels, left, right):
        x += lft
        ax.set_position((x / fw, y0 / fh, width / fw, height / fh))
        x += 1.05 * width
        cax.set_position((x / fw, (y0 + height / 2 - 10 * cb_width) / fh, cb_width / fw, 20 * cb_width / fh))
        x += cb_width + rgt + gap


def underflow_figure(census: pd.DataFrame, model: str, out=None) -> Figure:
    """Per layer, fraction of gradient values that underflow in FP16: layers x modes, from census.csv.

    FP32 runs give the counterfactual columns (what FP16 would flush at scale 1, 128, 1024, 65536); FP16 runs
    give the scale they used. One panel per gradient source (activation / weight gradients)."""
    title = f"{model}: per-layer FP16 underflow (census)"
    c = census[census["model"] == model] if len(census) else census
    if c.empty:
        return note_figure(title, "no census.csv in this model's runs (runs from before the gradient census "
                                  "have none)", out)
    sources = sorted(c["source"].unique(), key=lambda x: (x not in D.SOURCES, x))
    tables = {s: D.underflow_by_layer(census, model, s) for s in sources}
    n_layers = max(len(t) for t in tables.values())
    n_cols = sum(len(t.columns) for t in tables.values())
    fig = new_figure(max(7.0, 0.55 * n_cols + 4), max(3.5, ROW_INCHES * n_layers + 2.4), layout=None,
                     dpi=DPI if out is not None else None)  # laid out for the dpi it is drawn at
    panels = []
    for i, s in enumerate(sources):
        ax = fig.add_axes((i / len(sources), 0.1, 0.6 / len(sources), 0.8))  # placed by _place_heatmaps
        panels.append((ax, _heatmap(ax, tables[s], fig)))
        ax.set_title(SOURCE_TITLES.get(s, s), fontsize=10)
    # the note on lines of its own: on one line it ran off both edges of a one-mode figure (7 inches wide)
    sup = fig.suptitle(f"{title}\n{HEATMAP_NOTE},\nsummed over census steps and seeds", fontsize=10)
    _place_heatmaps(fig, panels, sup)
    return _done(fig, out)


def overflow_figure(steps: pd.DataFrame, model: str, out=None, top: int = 10) -> Figure:
    """Overflow steps by where they started (steps.csv first_nonfinite_layer/source), one bar per origin
    stacked by mode; one panel for the initial descent (before a run's first clean step), one in training."""
    title = f"{model}: where overflow steps start (first non-finite gradient in backward order)"
    o = D.overflow_origins(steps, model)
    if o.empty:
        return note_figure(title, "no overflow step in this model's runs", out)
    colors = mode_colors(R.mode_order(steps.loc[steps["model"] == model, "mode"].unique()))
    phases = [p for p in D.OVERFLOW_PHASES if (o["phase"] == p).any()]
    rows = max(min(top, o.loc[o["phase"] == p, "origin"].nunique()) for p in phases)
    fig = new_figure(6.0 * len(phases) + 2.0, max(3.0, 0.35 * rows + 1.8))
    axes = fig.subplots(1, len(phases), squeeze=False)[0]
    labels = {"initial descent": "before each run's first clean step", "in training": "after it"}
    for ax, phase in zip(axes, phases):
        t = o[o["phase"] == phase].pivot_table(index="origin", columns="mode", values="steps", aggfunc="sum",
                                               fill_value=0, sort=False)
        t = t.loc[t.sum(axis=1).sort_values(ascending=False, kind="stable").index[:top]].iloc[::-1]
        left = np.zeros(len(t))
        for mode in [m for m in colors if m in t.columns]:
            ax.barh(range(len(t)), t[mode], left=left, height=0.7, color=colors[mode], label=mode)
            left += t[mode].to_numpy()
        ax.set_yticks(range(len(t)), t.index, fontsize=7)
        ax.set_ylim(len(t) - rows - 0.5, len(t) - 0.5)  # the same bar height in both panels, from the top
        ax.set_xlabel("overflow steps (all seeds)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{phase}: {labels[phase]} ({int(o.loc[o['phase'] == phase, 'steps'].sum())} steps)",
                     fontsize=9)
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    fig.legend([handles[m] for m in colors if m in handles], [m for m in colors if m in handles], fontsize=7,
               loc="outside right center")
    fig.suptitle(title, fontsize=10)
    return _done(fig, out)


def underflow_steps_figure(census: pd.DataFrame, model: str, mode: str, source: str = "activation_grad",
                           seed: int | None = None, at_scale: float | None = None, out=None) -> Figure:
    """One run's per-layer underflow fraction at each census step (layers x steps)."""
    t = D.underflow_over_steps(census, model, mode, source, seed=seed, at_scale=at_scale)
    title = f"{model}/{mode}: {SOURCE_TITLES.get(source, source)} underflow per census step"
    if t.empty:
        return note_figure(title, f"no census rows for {model}/{mode} ({source})", out)
    fig = new_figure(max(6.0, 0.5 * len(t.columns) + 4), max(3.5, ROW_INCHES * len(t) + 2.4), layout=None,
                     dpi=DPI if out is not None else None)  # laid out for the dpi it is drawn at
    ax = fig.add_axes((0.1, 0.1, 0.6, 0.8))  # placed by _place_heatmaps
    cax = _heatmap(ax, t, fig)
    ax.set_xlabel("optimizer step")
    ax.set_title(title + "\n" + HEATMAP_NOTE, fontsize=9)
    _place_heatmaps(fig, [(ax, cax)])
    return _done(fig, out)


def _seed_scale(ax, r: pd.DataFrame, color, label: str):
    """One seed's loss scale: a step line, x on skipped steps, a dashed line where it fell back to FP32."""
    sk = r[r["skipped"].astype(bool)]
    ax.step(r["step"], r["scale"], where="post", color=color, lw=1.3, label=label)
    ax.plot(sk["step"], sk["scale"], "x", color=color, ms=6)
    fb = r[r["precision"] == "fp32"]
    if len(fb):
        ax.axvline(fb["step"].min(), color=color, ls="--", lw=1)
        ax.text(fb["step"].min(), 0.05, " FP32 fallback", color=color, fontsize=7, transform=ax.get_xaxis_transform())


def _seed_values(ax, r: pd.DataFrame, column: str, color, label: str):
    """One seed's `column` over steps, ▼ at the top of the panel where it is inf/nan."""
    ax.plot(r["step"], r[column].where(np.isfinite(r[column])), color=color, lw=1, label=label)
    bad = r[~np.isfinite(r[column])]
    if len(bad):
        ax.plot(bad["step"], np.full(len(bad), 1.0), "v", color=color, ms=5, transform=ax.get_xaxis_transform(),
                clip_on=False)


def _scale_panel(ax, s: pd.DataFrame, fp16: bool):
    """The loss-scale panel's axis, title and legend; for a mode without loss scaling, a note instead."""
    if fp16:
        _pow2_axis(ax, s["scale"])
        ax.plot([], [], "x", color="k", label="skipped step")
        skipped = int(s["skipped"].astype(int).sum())
        n = s["seed"].nunique()
        ax.set_title(f"loss scale ({skipped} skipped of {len(s)} steps, {n} seed{'s' * (n > 1)})", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    else:
        ax.set_axis_off()
        # the mode's name first: an FP8 recipe's runs record precision bf16, and "bf16" over fp8-delayed misleads
        mode, precision = s["mode"].iloc[0], s["precision"].iloc[0]
        ax.text(0.5, 0.5, f"{mode}: no loss scaling" + ("" if mode == precision else f" (precision {precision})"),
                ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("loss scale")


def _loss_and_norm_panels(ax_loss, ax_norm, s: pd.DataFrame):
    """Axes, labels and legend of the training-loss and gradient-norm panels."""
    # a log axis needs one positive finite value: a run whose every step overflowed has no gradient norm
    for ax, column in ((ax_loss, "loss"), (ax_norm, "grad_norm")):
        values = s[column].to_numpy(dtype=float)
        if (np.isfinite(values) & (values > 0)).any():
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, f"no finite {column.replace('_', ' ')}: every step overflowed", ha="center",
                    va="center", transform=ax.transAxes, fontsize=8)
    ax_loss.set_ylabel("training loss\n(▼ inf/nan)")
    ax_norm.set_ylabel("gradient norm\n(unscaled; ▼ inf/nan)")
    ax_norm.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_norm):
        ax.grid(True, alpha=0.25)
    ax_loss.legend(fontsize=7, loc="upper right")


def run_dynamics_figure(steps: pd.DataFrame, model: str, mode: str, out=None) -> Figure:
    """One mode's runs, seed by seed: loss scale (skips marked), training loss, gradient norm over steps."""
    s = steps[(steps["model"] == model) & (steps["mode"] == mode)] if len(steps) else steps
    title = f"{model} / {mode}"
    if s.empty:
        return note_figure(title, "no steps.csv for this mode", out)
    fig = new_figure(9, 7)
    ax_scale, ax_loss, ax_norm = fig.subplots(3, 1, sharex=True)
    cmap = matplotlib.colormaps["tab10"]
    fp16 = (s["precision"] == "fp16").any()
    for rank, (seed, r) in enumerate(s.groupby("seed")):
        color, label = cmap(rank % 10), f"seed {seed}"
        if fp16:
            _seed_scale(ax_scale, r, color, label)
        _seed_values(ax_loss, r, "loss", color, label)
        _seed_values(ax_norm, r, "grad_norm", color, label)
    _scale_panel(ax_scale, s, fp16)
    _loss_and_norm_panels(ax_loss, ax_norm, s)
    fig.suptitle(title)
    return _done(fig, out)


# --- all of a study's figures -------------------------------------------------------------------------------
def planted_steps(metrics: pd.DataFrame, model: str) -> list[int]:
    """Steps at which any of the model's runs planted a fault (lab.study.planted.planted_steps)."""
    from lab.study.planted import planted_steps as steps_of
    return steps_of(metrics[metrics["model"] == model]) if len(metrics) else []


def write_all(source, out: str | Path, models: list[str] | None = None, study_modes=()) -> list[Path]:
    """Write every figure of every model (or of `models`) under `out`; returns the paths written. A mode of
    `study_modes` a model has no runs of (a family that trains some modes only) gets a figure saying so."""
    metrics = R.load_metrics(source)
    steps = R.load_steps(source)
    census = R.load_census(source)
    hist = R.load_hist(source)
    models = models or D.models_in(metrics, steps)
    written = []
    for model in models:
        planted = planted_steps(metrics, model)
        figs = {
            "scale": lambda p: scale_figure(steps, model, p, planted),
            "loss": lambda p: loss_figure(steps, model, p),
            "grad_hist": lambda p: grad_hist_figure(hist, census, model, p),
            "top1": lambda p: top1_figure(metrics, model, p),
            "underflow": lambda p: underflow_figure(census, model, p),
            "overflow": lambda p: overflow_figure(steps, model, p),
        }
        assert set(figs) == set(R.MODEL_FIGURES)
        for name, make in figs.items():
            path = R.figure_path(out, model, name)
            make(path)
            written.append(path)
        modes = R.mode_order(set(steps.loc[steps["model"] == model, "mode"]) |
                             set(metrics.loc[metrics["model"] == model, "mode"]))
        for mode in modes:
            path = R.mode_figure_path(out, model, mode)
            run_dynamics_figure(steps, model, mode, path)
            written.append(path)
        for mode in (m for m in study_modes if m not in modes):
            path = R.mode_figure_path(out, model, mode)
            note_figure(f"{model} / {mode}", "not trained on this family (the study's models.<family>.modes)", path)
            written.append(path)
    return written

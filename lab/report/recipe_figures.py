"""The FP8/FP4 recipe study's figure (results/fp8/figures/recipes.png): per family, each recipe's validation loss
against BF16 on the same seeds (FP32's in a study without BF16 runs; mean and 95% t interval over seeds) beside the
share of values it flushed and saturated per tensor kind (log scale: the shares span 0.0001% to 100%)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import files

KINDS = ("activation", "weight", "gradient")


def _reference(t: pd.DataFrame) -> str | None:
    """The mode the loss panel measures against: BF16 where the family has paired BF16 runs, else FP32 (a study
    without BF16 runs, the controllers'), else none."""
    for ref in ("bf16", "fp32"):
        if np.isfinite(t[f"delta_vs_{ref}"].to_numpy(dtype=float)).any():
            return ref
    return None


def _rows(ax, n: int) -> None:
    """Every other row shaded: the three kinds' marks sit a quarter row apart, the bands say whose row they are."""
    for y in range(0, n, 2):
        ax.axhspan(y - 0.5, y + 0.5, color="0.93", zorder=0, lw=0)
    ax.set_ylim(-0.5, n - 0.5)


def _loss_panel(ax, t: pd.DataFrame, family: str, y) -> None:
    ref = _reference(t)
    _rows(ax, len(t))
    ax.set_yticks(y, t["mode"])
    if ref is None:
        ax.text(0.5, 0.5, "no BF16 or FP32 runs paired by seed:\nno loss difference to draw", ha="center",
                va="center", transform=ax.transAxes, fontsize=9, color="0.3")
        ax.set_title(f"{family}: validation loss")
        return
    from matplotlib.ticker import MaxNLocator
    ax.errorbar(t[f"delta_vs_{ref}"], y, xerr=t[f"delta_vs_{ref}_ci"].fillna(0), fmt="o", color="C0", capsize=3)
    ax.xaxis.set_major_locator(MaxNLocator(6))  # a narrow interval's ticks (-0.075, -0.05, ...) would run together
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel(f"validation loss − {ref.upper()}'s, same seeds (nats; 95% t interval)")
    ax.set_title(f"{family}: loss against {ref.upper()}")


def _shares_panel(ax, t: pd.DataFrame, family: str, y, columns) -> None:
    from matplotlib.ticker import NullFormatter
    _rows(ax, len(t))
    h = 0.25
    for i, kind in enumerate(KINDS):
        for what, marker in (("flushed", "o"), ("saturated", "x")):
            v = t[f"{what}_{kind}_pct"].to_numpy(dtype=float)
            ok = np.isfinite(v) & (v > 0)
            ax.scatter(v[ok], y[ok] + (i - 1) * h, marker=marker, color=f"C{i}", label=f"{what} {kind}")
    values = t[columns].to_numpy(dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    if len(values):  # a log axis over whole decades (at least two labelled ticks, none crowding), marks off its edge
        ax.set_xscale("log")
        lo, hi = np.floor(np.log10(values.min())), np.ceil(np.log10(values.max()))
        ax.set_xlim(10 ** (lo - 0.25), 10 ** (max(hi, lo + 1) + 0.25))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(y, t["mode"])
    ax.set_xlabel("% of values (census steps; zero: not drawn)")
    ax.set_title(f"{family}: flushed (o), saturated (x)")


def recipes_figure(table: pd.DataFrame, out: str | Path) -> Path:
    """`draw` written atomically to `out`."""
    fig = draw(table)
    out = Path(out)
    files.atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")
    return out


def draw(table: pd.DataFrame):
    """The figure, drawn on a Figure of its own (no pyplot state: a notebook's backend stays as it was), for the
    families with recipe runs. The legend sits above the panels, off the data."""
    from matplotlib.figure import Figure
    shares = table[[f"{w}_{k}_pct" for w in ("flushed", "saturated") for k in KINDS]]
    families = list(table.loc[shares.notna().any(axis=1), "model"].unique())
    if not families:
        raise ValueError("no recipe runs to draw: the table has no saturated or flushed shares")
    rows = max(len(table[table["model"] == f]) for f in families)
    height = (0.45 * max(rows, 4) + 1) * len(families) + 0.5
    fig = Figure(figsize=(12, height))
    axes = fig.subplots(len(families), 2, squeeze=False)
    for row, family in zip(axes, families):
        t = table[table["model"] == family]
        ref = _reference(t)
        t = t[~t["mode"].isin([ref or "bf16"])].iloc[::-1]  # the reference itself: no difference to show
        y = np.arange(len(t))
        _loss_panel(row[0], t, family, y)
        _shares_panel(row[1], t, family, y, shares.columns)
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))
    return fig

"""The FP8/FP4 recipe study's figure (results/fp8/figures/recipes.png): per family, each recipe's validation loss
against BF16 on the same seeds (mean and 95% t interval over seeds) beside the share of values it flushed and
saturated per tensor kind (log scale: the shares span 0.0001% to 100%)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from lab.core import files

KINDS = ("activation", "weight", "gradient")


def recipes_figure(table: pd.DataFrame, out: str | Path) -> Path:
    """The figure, drawn on a Figure of its own (no pyplot state: a notebook's backend stays as it was), for the
    families with recipe runs; written atomically to `out`."""
    from matplotlib.figure import Figure
    shares = table[[f"{w}_{k}_pct" for w in ("flushed", "saturated") for k in KINDS]]
    families = list(table.loc[shares.notna().any(axis=1), "model"].unique())
    if not families:
        raise ValueError("no recipe runs to draw: the table has no saturated or flushed shares")
    rows = max(len(table[table["model"] == f]) for f in families)
    fig = Figure(figsize=(12, (0.45 * max(rows, 4) + 1) * len(families)))
    axes = fig.subplots(len(families), 2, squeeze=False)
    for row, family in zip(axes, families):
        t = table[(table["model"] == family) & ~table["mode"].isin(["bf16"])].iloc[::-1]
        y = np.arange(len(t))
        ax = row[0]
        ax.errorbar(t["delta_vs_bf16"], y, xerr=t["delta_vs_bf16_ci"].fillna(0), fmt="o", color="C0", capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(y, t["mode"])
        ax.set_xlabel("validation loss − BF16's, same seeds (nats; 95% t interval)")
        ax.set_title(f"{family}: loss against BF16")
        ax = row[1]
        h = 0.25
        for i, kind in enumerate(KINDS):
            for what, marker in (("flushed", "o"), ("saturated", "x")):
                v = t[f"{what}_{kind}_pct"].to_numpy(dtype=float)
                ok = np.isfinite(v) & (v > 0)
                ax.scatter(v[ok], y[ok] + (i - 1) * h, marker=marker, color=f"C{i}",
                           label=f"{what} {kind}" if family == families[0] else None)
        if (t[shares.columns].to_numpy(dtype=float) > 0).any():  # a log axis needs a positive value
            ax.set_xscale("log")
        ax.set_yticks(y, t["mode"])
        ax.set_xlabel("% of values (census steps; zero: not drawn)")
        ax.set_title(f"{family}: flushed (o) and saturated (x), per tensor kind")
    axes[0][1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    files.atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")
    return out

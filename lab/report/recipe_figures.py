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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    families = list(table["model"].unique())
    fig, axes = plt.subplots(len(families), 2, figsize=(12, 0.45 * max(len(table) // max(len(families), 1), 4) *
                                                        len(families) + 1), squeeze=False)
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
        ax.set_xscale("log")
        ax.set_yticks(y, t["mode"])
        ax.set_xlabel("% of values (census steps; zero: not drawn)")
        ax.set_title(f"{family}: flushed (o) and saturated (x), per tensor kind")
    axes[0][1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    files.atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")
    plt.close(fig)
    return out

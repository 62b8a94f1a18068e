"""A Pareto figure a person can read: every point numbered, the numbers' key beside the plot, the front drawn.

Many rules land on one spot (GradScaler's relatives skip and flush alike), so names printed at the points pile up.
Here each point carries its number from the key; points whose markers overlap on the drawn axes share one label
("3,4,5"), and each label takes the first of a few fixed offsets where it overlaps no label placed before it (no
randomness: the same table gives the same picture). The front (`front`, from the caller) is drawn as the staircase
bounding what it dominates, both axes lower-is-better. matplotlib only (lab.report.figures' canvas and save).
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import FuncFormatter

MARKER_PX = 9.0  # markers closer than this (display pixels) overlap: their numbers share one label
# label offsets from its point, in points: right-above, right-below, left-above, left-below, then further out
OFFSETS = ((4, 3), (4, -10), (-4, 3), (-4, -10), (4, 12), (4, -19), (-4, 12), (-4, -19), (4, 21), (4, -28))


def front_steps(xs, ys, front) -> tuple[list[float], list[float]]:
    """The front's points sorted along x, for a post-step line: on a front of two lower-is-better objectives, x
    rising means y falling; coincident points appear once."""
    pts = sorted({(x, y) for x, y, f in zip(xs, ys, front) if f and math.isfinite(x) and math.isfinite(y)})
    return [x for x, _ in pts], [y for _, y in pts]


def _clusters(disp: list[tuple[float, float]]) -> list[list[int]]:
    """Indices of points grouped where markers overlap (single linkage within MARKER_PX), in first-index order."""
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(disp):
        near = [g for g in groups if any(math.hypot(x - disp[j][0], y - disp[j][1]) < MARKER_PX for j in g)]
        merged = [i] + [j for g in near for j in g]
        groups = [g for g in groups if g not in near] + [sorted(merged)]
    return sorted(groups, key=lambda g: g[0])


def _place_labels(ax, xs, ys, numbers) -> list:
    """Each cluster's numbers at the first offset whose box overlaps no marker and no label placed before it (else
    the first offset); the labels, in the clusters' order."""
    from matplotlib.transforms import Bbox
    renderer = ax.figure.canvas.get_renderer()
    disp = [tuple(ax.transData.transform((x, y))) for x, y in zip(xs, ys)]
    r = MARKER_PX / 2
    markers = [Bbox.from_extents(x - r, y - r, x + r, y + r) for x, y in disp]
    placed, labels = [], []
    for group in _clusters(disp):
        if not all(map(math.isfinite, disp[group[0]])):  # a missing value: no point drawn, the key lists it alone
            continue
        text = ",".join(str(numbers[i]) for i in group)
        x, y = xs[group[0]], ys[group[0]]
        for dx, dy in OFFSETS:
            label = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                                ha="left" if dx > 0 else "right")
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in placed + markers):
                break
            label.remove()
        else:  # nowhere free: the first offset, overlapping
            label = ax.annotate(text, (x, y), xytext=OFFSETS[0], textcoords="offset points", fontsize=7)
            box = label.get_window_extent(renderer)
        placed.append(box)
        labels.append(label)
    return labels


def _key(key_ax, names, kinds, front, colors, handles) -> None:
    """The numbers' key (bold: on the front; coloured by kind), then the legend of kinds and the front."""
    key_ax.axis("off")
    step = min(0.055, 0.62 / max(len(names), 1))  # the key in the top 2/3, the legend under it
    size = min(7.0, step * key_ax.bbox.height * 72 / key_ax.figure.dpi / 1.3)  # a long key: smaller, not piled
    key_ax.text(0, 1, "key (bold: on the front)", fontsize=7.5, va="top", transform=key_ax.transAxes)
    for i, (name, kind, on) in enumerate(zip(names, kinds, front)):
        key_ax.text(0, 0.95 - i * step, f"{i + 1:>2}  {name}", fontsize=size, va="top", family="monospace",
                    color=colors.get(kind, "black"), weight="bold" if on else "normal", transform=key_ax.transAxes)
    key_ax.legend(handles=handles, loc="lower left", fontsize=7, frameon=False, bbox_to_anchor=(0, 0))


def pareto_figure(points, front, colors: dict, labels: dict, path: Path, scales: dict | None = None) -> Path:
    """`draw` saved to `path` (lab.report.figures.save: atomic, at its dpi)."""
    from lab.report import figures as F
    return F.save(draw(points, front, colors, labels, scales), path)


def draw(points, front, colors: dict, labels: dict, scales: dict | None = None):
    """The figure of `points` (columns x, y, name, kind; one row a rule): numbered markers coloured by kind, the
    front's staircase and rings, the key beside. `front`: one bool per row; `labels`: xlabel, ylabel, title;
    `scales`: keyword arguments of set_xscale/set_yscale as {"x": {...}, "y": {...}}."""
    from lab.report import figures as F
    fig = F.new_figure(9.0, 4.6, layout=None, dpi=F.DPI)  # laid out by hand: label boxes are measured as drawn
    ax = fig.add_axes((0.09, 0.12, 0.55, 0.78))
    key_ax = fig.add_axes((0.67, 0.04, 0.32, 0.9))
    xs, ys = list(map(float, points["x"])), list(map(float, points["y"]))
    for kind in dict.fromkeys(points["kind"]):
        d = points[points["kind"] == kind]
        ax.scatter(d["x"], d["y"], c=colors.get(kind), label=kind, s=28, zorder=3)
    fx, fy = front_steps(xs, ys, front)
    ax.step(fx, fy, where="post", color="black", lw=1, zorder=2)
    # the front's points ringed too: a front of one spot (every rule that neither skips nor flushes) has no line
    ax.scatter(fx, fy, s=90, facecolors="none", edgecolors="black", lw=1, zorder=4,
               label="Pareto front (lower is better on both axes)")
    for axis, kw in (scales or {}).items():
        getattr(ax, f"set_{axis}scale")(**kw)
        # plain numbers (0.01, 1, 10), not powers of ten: the values are read off, not their exponents
        getattr(ax, f"{axis}axis").set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set(xlabel=labels["xlabel"], ylabel=labels["ylabel"], title=labels["title"])
    ax.grid(alpha=0.3, lw=0.5)
    ax.margins(0.08)
    fig.canvas.draw()  # the limits and transforms final before the labels are measured
    _place_labels(ax, xs, ys, list(range(1, len(xs) + 1)))
    _key(key_ax, list(points["name"]), list(points["kind"]), front, colors, ax.get_legend_handles_labels()[0])
    return fig

"""The RL study's figures (``python -m lab rl-figures``): per mode, the training reward with its band over seeds; the
per-token mismatch |log pi - log mu| as a histogram per pair of formats (sampler / learner); the loss scale of each
FP16 mode. Read from the run folders (rl_steps.csv, rl_mismatch_hist.csv, steps.csv); matplotlib and pandas only.
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.core import files
from lab.core.runfiles import read_csv_frame
from lab.rl.grpo_study import mode_seeds, mode_train, rl_runs, run_folder

__all__ = ["rl_figures", "FIGURES"]

FIGURES = ("reward.png", "mismatch_hist.png", "scale.png")


def _frames(study: dict, name: str, required: tuple) -> dict:
    return {(mode, seed): read_csv_frame(run_folder(study, mode, seed) / name, required)
            for mode, seed in rl_runs(study)}


def _save(fig, path: Path) -> None:
    files.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), mode="wb")


def _t_half(frame):
    """Each row's 95% Student-t half width of the mean over the columns (seeds); 0 with one seed."""
    from scipy import stats
    n = frame.shape[1]
    if n < 2:
        return frame.mean(axis=1) * 0
    return frame.std(axis=1, ddof=1) / n ** 0.5 * stats.t.ppf(0.975, n - 1)


def rl_figures(study: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out)
    steps_frames = _frames(study, "rl_steps.csv", ("step", "reward"))
    hists = _frames(study, "rl_mismatch_hist.csv", ("upper", "tokens"))
    scales = _frames(study, "steps.csv", ("step", "scale"))
    written = []

    arms: dict = {}  # modes grouped by their run length: one panel each
    for name in study["modes"]:
        arms.setdefault(mode_train(study, name)["steps"], []).append(name)
    fig, axes = plt.subplots(1, len(arms), figsize=(7 * len(arms), 4), squeeze=False)
    for ax, (steps, names) in zip(axes[0], sorted(arms.items())):
        for mode in names:
            seeds = mode_seeds(study, mode)
            frames = [steps_frames[(mode, s)].set_index("step")["reward"] for s in seeds]
            joined = frames[0].to_frame("r0").join([f.rename(f"r{i}") for i, f in enumerate(frames[1:], 1)])
            # a rolling mean over 1/30 of the run: one batch's reward is 128 samples' share, noisy step to step
            smooth = joined.rolling(max(1, steps // 30), min_periods=1).mean()
            mean, half = smooth.mean(axis=1), _t_half(smooth)
            line, = ax.plot(smooth.index, mean, label=f"{mode} ({len(seeds)})", lw=1.2)
            ax.fill_between(smooth.index, mean - half, mean + half, color=line.get_color(), alpha=0.12)
        ax.set(xlabel="GRPO step", ylabel="reward (training batch, rolling mean)",
               title=f"{steps}-step runs: mean over seeds (n) and its 95% t interval")
        ax.legend(fontsize=6, ncol=2)
    _save(fig, out / "reward.png")
    written.append(out / "reward.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    by_formats: dict = {}
    for name, mode in study["modes"].items():
        key = f"sampler {mode.sampler} / learner {mode.learner}"
        for seed in mode_seeds(study, name):
            h = hists[(name, seed)]
            by_formats[key] = h["tokens"] if key not in by_formats else by_formats[key] + h["tokens"]
            uppers = list(h["upper"])
    for key, counts in sorted(by_formats.items()):
        total = counts.sum()
        # the exact zeros at the left edge (1e-11), the bins at their upper edges
        xs = [1e-11] + [u for u in uppers[1:] if math.isfinite(u)] + [1e2]
        ax.step(xs, list(counts / total), where="pre", label=f"{key} ({int(total)} tokens)")
    ax.set(xscale="log", xlabel="|log pi - log mu| per generated token (exact zeros at the left)",
           ylabel="share of tokens", title="The sampler/learner mismatch per pair of formats")
    ax.legend(fontsize=7)
    _save(fig, out / "mismatch_hist.png")
    written.append(out / "mismatch_hist.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(arms), figsize=(7 * len(arms), 4), squeeze=False)
    for ax, (steps, names) in zip(axes[0], sorted(arms.items())):
        for name in names:
            if study["modes"][name].scaler is None:
                continue
            seed = mode_seeds(study, name)[0]
            frame = scales[(name, seed)]
            ax.plot(frame["step"], frame["scale"], label=f"{name} (seed {seed})", lw=1.2, drawstyle="steps-post")
        ax.set(yscale="log", xlabel="GRPO step", ylabel="loss scale", title=f"The loss scale, {steps}-step runs")
        ax.legend(fontsize=6)
    _save(fig, out / "scale.png")
    written.append(out / "scale.png")
    plt.close(fig)
    return written

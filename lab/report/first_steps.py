"""The vision branch over a multimodal run's first steps: the encoder's feature spread and each branch's
gradient range, step by step, measured by training the run again with hooks and stopping after N steps.

A CPU run repeats itself bit for bit with the same config, seed and thread count
(tests/test_resume.py::test_same_config_and_seed_repeat_exactly), so the steps measured here are the study's own:
`measure` checks that every measured step's training loss equals the run's steps.csv, and refuses otherwise.

    python -m lab first-steps --config configs/multimodal.yaml --model vlm --modes fp32 fp16-dynamic --seed 0 \
        --steps 300 --csv results/multimodal/tables/first_steps.csv --png results/multimodal/figures/vlm/first_steps.png
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pandas as pd

from lab.core import runfiles
from lab.models.multimodal import BRANCHES, branch_of


class FirstStepsError(ValueError):
    """The run cannot be measured (not a vision-language model) or its steps differ from the run's own."""


class _Enough(Exception):
    pass


def measure(cfg, steps: int, run_dir: str | Path | None = None) -> pd.DataFrame:
    """One row per optimizer step < ``steps`` of ``cfg``'s run: the encoder's output features' standard deviation
    (the training forward's), and per branch the largest and the smallest non-zero unscaled gradient magnitude
    (inf on an overflow step), the scale and the loss. With ``run_dir`` (the study's run) the losses are checked
    against its steps.csv."""
    import torch

    from lab.run import loop as loop_module
    from lab.run.train import train

    rows: list[dict] = []
    original_step, original_micro = loop_module.EpochLoop._optimizer_step, loop_module.EpochLoop._micro_batch

    def micro_batch(self, x, y, batches):
        if not hasattr(self, "_spread_hook"):
            encoder = getattr(self.model, "encoder", None)
            if encoder is None or not hasattr(self.model, "visual_features"):
                raise FirstStepsError(f"{cfg.model.preset}: not a vision-language model (no encoder's features)")
            self._spread = []
            self._spread_hook = encoder.blocks[-1].register_forward_hook(
                lambda m, i, out: self._spread.append(float(out.detach().float().std())) if self._want else None)
        self._want = True  # the training forward only, not the census's or the attribution's replays
        try:
            return original_micro(self, x, y, batches)
        finally:
            self._want = False

    def optimizer_step(self, epoch, loss, batches, active_precision):
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        row = {"step": self.state.step, "mode": cfg.mode.name, "scale": scale, "loss": float(loss.detach()) * self.divisor,
               "feature_std": self._spread[-1]}
        for branch in BRANCHES:
            grads = [p.grad.detach().float().abs() / scale for n, p in self.model.named_parameters()
                     if p.grad is not None and branch_of(n) == branch]
            flat = torch.cat([g.flatten() for g in grads]) if grads else torch.zeros(1)
            nonzero = flat[flat > 0]
            row[f"{branch}_grad_amax"] = float(flat.max())
            row[f"{branch}_grad_min_nonzero"] = float(nonzero.min()) if len(nonzero) else math.nan
        rows.append(row)
        if self.state.step + 1 >= steps:
            raise _Enough
        return original_step(self, epoch, loss, batches, active_precision)

    loop_module.EpochLoop._optimizer_step, loop_module.EpochLoop._micro_batch = optimizer_step, micro_batch
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train(cfg, Path(tmp) / "run", progress=open("/dev/null", "w"))
    except _Enough:
        pass
    finally:
        loop_module.EpochLoop._optimizer_step, loop_module.EpochLoop._micro_batch = original_step, original_micro
    table = pd.DataFrame(rows)
    if run_dir is not None:
        _check_same_run(table, Path(run_dir))
    return table


def _check_same_run(table: pd.DataFrame, run_dir: Path) -> None:
    """The measured losses must be the run's own, step for step (a different machine or thread count gives
    another trajectory: then the measurement is not of the study's run)."""
    own = runfiles.read_csv_frame(run_dir / "steps.csv", ("step", "loss"), usecols=["step", "loss"])
    own = own.set_index("step")["loss"]
    mine = table.set_index("step")["loss"]
    common = mine.index.intersection(own.index)
    off = (mine[common] - own[common]).abs() > 1e-6 * own[common].abs().clip(lower=1.0)
    if len(common) < len(mine) or off.any():
        first = common[off.to_numpy()][0] if off.any() else None
        raise FirstStepsError(f"{run_dir}: the measured steps are not the run's own (first differing step {first}; "
                              "another machine, thread count or code): measure where the study ran")


def figure(table: pd.DataFrame, out=None):
    """Three panels over the steps: the encoder's feature spread, each branch's largest unscaled gradient with
    the level above which FP16 overflows at 2^16 and 2^14 (65504 / scale), and each branch's smallest non-zero one."""
    from lab.report.figures import _done, mode_colors, new_figure
    fp16_max = 65504.0
    fig = new_figure(11, 8.5)
    axes = fig.subplots(3, 1, sharex=True)
    colors = mode_colors(table["mode"].unique())
    styles = {"encoder": "-", "projector": ":", "decoder": "--"}
    for mode, r in table.groupby("mode", sort=False):
        axes[0].plot(r["step"], r["feature_std"], color=colors[mode], label=mode)
        for branch in BRANCHES:
            axes[1].semilogy(r["step"], r[f"{branch}_grad_amax"], styles[branch], color=colors[mode], lw=1,
                             label=f"{mode}: {branch}")
            axes[2].semilogy(r["step"], r[f"{branch}_grad_min_nonzero"], styles[branch], color=colors[mode], lw=1,
                             label=f"{mode}: {branch}")
    for exp in (16, 14):
        axes[1].axhline(fp16_max / 2 ** exp, color="0.3", lw=0.8, ls="-." if exp == 16 else ":",
                        label=f"overflows at scale 2^{exp} above this")
    axes[0].set_ylabel("encoder features' std")
    axes[1].set_ylabel("largest |grad| (unscaled)")
    axes[2].set_ylabel("smallest non-zero |grad|")
    axes[2].set_xlabel("optimizer step")
    axes[0].set_title("vision branch over the first steps: feature spread and gradient range per branch")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return _done(fig, out)


def write(study: dict, model: str, modes, seed: int, steps: int, threads: int, csv_path, png_path) -> None:
    """`python -m lab first-steps`: each mode's run of ``model`` and ``seed`` measured (checked against the study's
    run where it exists), the table to ``csv_path`` and the figure to ``png_path``."""
    import sys

    import matplotlib
    matplotlib.use("Agg")
    import torch

    from lab.core import files
    from lab.core.config import resolve_run
    from lab.core.study import run_folder
    torch.set_num_threads(threads)
    tables = []
    for mode in modes:
        run = resolve_run(study, model, mode, seed)
        run_dir = run_folder(study, model, mode, seed)
        tables.append(measure(run, steps, run_dir if (run_dir / "steps.csv").is_file() else None))
        print(f"{model}/{mode}/seed{seed}: {len(tables[-1])} steps measured", file=sys.stderr)
    table = pd.concat(tables, ignore_index=True)
    files.atomic_write_text(csv_path, table.to_csv(index=False))
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    figure(table, png_path)

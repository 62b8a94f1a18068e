"""The amax histories recorded runs hold, as sequences (oldest step first) for learning and judging predictors:

* ``fp16``: a run's ``steps.csv`` ``grad_amax`` (every run, every step: the unscaled gradients' largest magnitude
  at ``unscale_``, what amax-history and amax-predicted observe; inf or NaN on a step the run overflowed);
* ``fp8``: a recipe run's ``fp8_amax.csv`` (lab/fp8/state.py): each converted linear's input, weight and output
  gradient amax at every step, a sequence per (layer, role).

Files are read through lab.core.runfiles (a damaged one: RunFileError naming it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lab.core import runfiles

FP8_FILE = "fp8_amax.csv"


@dataclass
class History:
    run: str       # the run directory
    tensor: str    # "grad" (fp16), or "layer/role" (fp8)
    role: str      # "grad" (fp16) or input / weight / grad_output (fp8)
    amax: torch.Tensor  # (steps,) float64, oldest first


def _fp16(run_dir: Path) -> list[History]:
    from lab.diagnose.replay import ReplayError, read_run  # the replay's reader of steps.csv, the one there is
    try:
        record = read_run(run_dir)
    except ReplayError:  # no steps.csv, or none with grad_amax: nothing to learn from here
        return []
    return [History(str(run_dir), "grad", "grad", torch.tensor(record.amax, dtype=torch.float64))]


def _fp8(run_dir: Path) -> list[History]:
    path = run_dir / FP8_FILE
    if not path.is_file():
        return []
    _, rows = runfiles.read_csv(path, ("step", "layer", "role", "amax"), live=runfiles.is_live(path))
    seqs: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        seqs.setdefault((r["layer"], r["role"]), []).append(
            (runfiles.number(path, r, "step", int), runfiles.number(path, r, "amax")))
    return [History(str(run_dir), f"{layer}/{role}", role,
                    torch.tensor([a for _, a in sorted(v)], dtype=torch.float64))
            for (layer, role), v in sorted(seqs.items())]


def read(run_dirs, kind: str) -> list[History]:
    """Every history of ``kind`` ("fp16" or "fp8") the run directories hold; a run without one adds none."""
    if kind not in ("fp16", "fp8"):
        raise ValueError(f"kind must be fp16 or fp8, got {kind!r}")
    reader = _fp16 if kind == "fp16" else _fp8
    return [h for d in run_dirs for h in reader(Path(d))]


def run_info(run_dir) -> dict:
    """A run's path, family, mode and seed (its config.yaml)."""
    run_dir = Path(run_dir)
    cfg = runfiles.read_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    mode = cfg.get("mode") if isinstance(cfg.get("mode"), dict) else {}
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    return {"path": str(run_dir), "model": model.get("family"), "mode": mode.get("name"), "seed": cfg.get("seed")}


def read_for_fit(run_dirs, read) -> tuple[list, list[dict]]:
    """``read(run_dir)`` of each run, and each run as a fitted model lists it: ``run_info`` and ``files``, the
    SHA-256 of every file read for it (by ``read`` and ``run_info``: config.yaml, whose train.emulated_accum sets
    the replay's divisor, as much as the histories), by name inside the run directory. The one place a fit opens
    run files: the list is what was read (lab.core.runfiles.recording), so it cannot miss one."""
    values, runs = [], []
    for run_dir in map(Path, run_dirs):
        with runfiles.recording() as read_files:
            info = run_info(run_dir)
            values.append(read(run_dir))
        files = {_inside(run_dir, path): digest for path, digest in sorted(read_files.items())}
        runs.append({**info, "files": files})
    return values, runs


def _inside(run_dir: Path, path: str) -> str:
    try:
        return Path(path).relative_to(run_dir).as_posix()
    except ValueError:  # not under the run directory: its full path
        return path

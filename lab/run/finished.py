"""A finished run's files, kept until the workflow has recorded the run.

Snakemake records a job as done only after its process has exited. A study killed in between (kill -9, a
lost node) or a SLURM job that finishes inside `KillWait` after its time limit leaves a run that finished
but that Snakemake holds incomplete: the next `snakemake` deletes its outputs and runs the job again. The
finished run has deleted its checkpoint, so it would train again from step 0.

With `lab train --recover-finished` (the workflow's train rule passes it) a finished run first copies its
files to RUN_DIR/.finished/, whole or not at all, and a run that finds a copy of its own configuration
there restores it instead of training. The workflow removes the copies when it ends (`onsuccess` and
`onerror` in the Snakefile: by then it has recorded every job that finished), so a later forced re-run trains
again. Only a copy that survives a killed workflow is ever restored.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from lab.core import files, runfiles

FOLDER = ".finished"
#: the train rule's outputs; metrics.json last: its presence means the run is complete
RUN_FILES = ("config.yaml", "steps.csv", "census.csv", "grad_hist.csv", "provenance.json", "outcomes.npz",
             "metrics.json")
#: written by some runs only: a base model's final weights (train.save_weights), a LoRA run's adapter log, the
#: gradients by position (train.position_probe)
OPTIONAL_FILES = ("weights.pt", "adapters.csv", "positions.csv")
NOT_RESULTS = ("failed", "running")  # a metrics.json with such a status is no finished run


def keep(run_dir: str | Path) -> Path:
    """Copy the run's files to run_dir/.finished/: a whole copy or none (built aside, then renamed)."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / FOLDER, run_dir / (FOLDER + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in OPTIONAL_FILES + RUN_FILES:
        if name in RUN_FILES or (run_dir / name).is_file():
            _copy(run_dir / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def restore(run_dir: str | Path, config_hash: str, write: bool = True) -> dict | None:
    """The metrics of run_dir/.finished/ when it holds a finished run of ``config_hash``, after copying its
    files back into run_dir (``write``; metrics.json last). None, and nothing written, otherwise.
    The copy stays: under torchrun every rank looks, and rank 0 alone writes."""
    src = Path(run_dir) / FOLDER
    try:
        metrics = runfiles.read_json(src / "metrics.json")
    except runfiles.RunFileError:  # missing or damaged: no finished run to restore
        return None
    if (not isinstance(metrics, dict) or metrics.get("config_hash") != config_hash
            or metrics.get("status") in NOT_RESULTS or not all((src / n).is_file() for n in RUN_FILES)):
        return None
    if write:
        for name in OPTIONAL_FILES + RUN_FILES:
            if name in RUN_FILES or (src / name).is_file():
                _copy(src / name, Path(run_dir) / name)
    return metrics


def drop(runs_root: str | Path) -> int:
    """Remove every .finished/ copy under runs_root (the workflow, once it has recorded its jobs)."""
    found = [p for p in Path(runs_root).rglob(FOLDER) if p.is_dir()] if Path(runs_root).is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return len(found)


def _copy(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    files.atomic_write(dst, lambda f: f.write(data), mode="wb")

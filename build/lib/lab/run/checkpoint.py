"""Checkpoints of a training run, written atomically, and the signals that ask for one.

A checkpoint is taken at an optimizer-step boundary and holds everything the rest of the run depends on
(lab/run/train.py builds the dict): model, optimizer, LR schedule, loss scaler, monitor (census) state, every
random-generator state, the data loader's generator as it was at the start of the epoch plus the number of
micro-batches of the epoch already used, the loop's counters, and how many rows of steps.csv.partial
belong to it. `python -m lab train` on a run directory that holds one resumes from it; a checkpoint of
another configuration is refused, naming both hashes.

Files: ``<run_dir>/checkpoint/step<NNNNNNNN>.pt``, written to a temporary file and renamed, so a kill while
writing leaves the previous checkpoint intact; the newest ``keep`` are kept. The folder is not a Snakemake
output, so a failed or killed job leaves it for the next attempt; a finished run deletes it.
"""
from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from lab.core import files

DIRNAME = "checkpoint"
RESUME_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run; the message says why."""


class Interrupted(RuntimeError):
    """A scheduler's signal arrived; the run saved a checkpoint and stops (exit status 128 + signal)."""

    def __init__(self, signum: int, path: Path):
        super().__init__(f"signal {signal.Signals(signum).name}: checkpoint written to {path}; run again to resume")
        self.signum = signum


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def folder(run_dir) -> Path:
    return Path(run_dir) / DIRNAME


def latest(run_dir) -> Path | None:
    files = sorted(folder(run_dir).glob("step*.pt"))
    return files[-1] if files else None


def save(run_dir, state: dict, keep: int = 1) -> Path:
    """Write ``state`` atomically as the checkpoint of step ``state['step']``; keep the newest ``keep``."""
    out = folder(run_dir)
    path = out / f"step{state['step']:08d}.pt"
    files.atomic_write(path, lambda f: torch.save(state, f), mode="wb")
    for old in sorted(out.glob("step*.pt"))[:-max(keep, 1)]:
        old.unlink(missing_ok=True)
    return path


def load(path: Path, config_hash: str, mmap: bool = False) -> dict:
    """The checkpoint at ``path``, refused when it belongs to another configuration. ``mmap``: tensors are
    mapped from the file, not read (a check that only looks at the config hash costs almost nothing)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # a truncated or foreign file: say which, never start over silently
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it to start "
                              f"the run from step 0") from None
    if state.get("config_hash") != config_hash:
        raise CheckpointError(f"checkpoint {path} belongs to config {state.get('config_hash')}, this run's config "
                              f"is {config_hash}: delete {path.parent} to start over, or use another run folder")
    return state


def remove(run_dir) -> None:
    shutil.rmtree(folder(run_dir), ignore_errors=True)


class SignalFlag:
    """While active, SIGTERM/SIGUSR1 (what SLURM and other schedulers send before a kill) only set a flag
    that the training loop checks at each step boundary. Outside the main thread it does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self):
        try:
            for s in RESUME_SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            self._old = {}
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)
        return False

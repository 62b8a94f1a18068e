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

A checkpoint holds only tensors and plain containers (dict, list, tuple, str, int, float, bool, None) and is
read with ``torch.load(weights_only=True)``: a run directory may come from a shared filesystem or someone
else's results, and a resume (a scheduler's retry) must not run code a file carries. A file that needs any
other type to load, including a checkpoint of the lab before this rule (its NumPy generator state was a NumPy
array), is refused naming the file and the type.
"""
from __future__ import annotations

import collections
import pickle
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


class DataIdentity:
    """A checkpoint component: the identity of the data a run trains on (token files: the corpus's and the
    tokenizer's hashes, the token counts). The config hash names the data's folder, not its content: a folder
    prepared again (``prepare-text --force``) under a run with a checkpoint is refused at resume, not mixed."""

    def __init__(self, identity: dict):
        self.identity = identity

    def state_dict(self) -> dict:
        return dict(self.identity)

    def load_state_dict(self, saved: dict) -> None:
        if saved != self.identity:
            changed = sorted(k for k in set(saved) | set(self.identity) if saved.get(k) != self.identity.get(k))
            raise CheckpointError(f"the checkpoint was written while training on other data ({', '.join(changed)} "
                                  f"differ from the data folder's now): delete the run's checkpoint folder to "
                                  f"start over on the new data, or restore the data it began with")


class Interrupted(RuntimeError):
    """A scheduler's signal arrived; the run saved a checkpoint and stops (exit status 128 + signal)."""

    def __init__(self, signum: int, path: Path):
        super().__init__(f"signal {signal.Signals(signum).name}: checkpoint written to {path}; run again to resume")
        self.signum = signum


def rng_state() -> dict:
    """Every generator's state as tensors and plain values (what weights_only=True loads back)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # the MT19937 key as int64: every uint32 fits, so the round trip is exact
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # a CUDA run's; a CPU run (on a GPU machine too) must not initialise CUDA here
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
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
    check_plain(state)
    out = folder(run_dir)
    path = out / f"step{state['step']:08d}.pt"
    files.atomic_write(path, lambda f: torch.save(state, f), mode="wb")
    for old in sorted(out.glob("step*.pt"))[:-max(keep, 1)]:
        old.unlink(missing_ok=True)
    return path


PLAIN = (str, int, float, bool, type(None))
CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def check_plain(obj, where: str = "checkpoint") -> None:
    """Refuse, before writing, an entry that weights_only=True would not load: caught at the first save of a
    run rather than as a checkpoint its resume refuses (a policy's state_dict holding a NumPy float, say)."""
    if isinstance(obj, torch.Tensor) or type(obj) in PLAIN:
        return
    if type(obj) not in CONTAINERS:
        raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}: a checkpoint holds only "
                        f"tensors and plain containers (it is loaded with torch.load(weights_only=True))")
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        check_plain(key, f"{where} key {key!r}")
        check_plain(value, f"{where}[{key!r}]")


def load(path: Path, config_hash: str, mmap: bool = False) -> dict:
    """The checkpoint at ``path``, refused when it needs more than tensors and plain containers to load (no
    code in it runs) or belongs to another configuration. ``mmap``: tensors are mapped from the file, not read
    (a check that only looks at the config hash costs almost nothing)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated, foreign or untrusted file: say which, never start over silently
        raise CheckpointError(_unreadable(path, e)) from None
    found = state.get("config_hash") if isinstance(state, dict) else None  # a loadable file of something else
    if found != config_hash:
        raise CheckpointError(f"checkpoint {path} belongs to config {found}, this run's config "
                              f"is {config_hash}: delete {path.parent} to start over, or use another run folder")
    return state


def _unreadable(path: Path, e: Exception) -> str:
    """One line. torch's weights-only refusal runs to many lines and advises weights_only=False, so the types
    are named from a scan of the file's pickle instead (a scan: nothing in it runs)."""
    if not isinstance(e, pickle.UnpicklingError):  # a truncated or foreign file
        return (f"checkpoint {path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())}); delete it to "
                f"start the run from step 0")
    try:
        needs = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a torch.save zip file: a bare pickle, say
        needs = ""
    return (f"checkpoint {path} needs {needs or 'more than weights_only=True loads'} to load, and a checkpoint "
            f"holds only tensors and plain containers: refused unread, since loading it could run code it carries "
            f"(a checkpoint of the lab before this rule is refused too); delete {path.parent} to start the run "
            f"from step 0")


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

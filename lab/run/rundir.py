"""A run directory's bookkeeping: the step log, the checks before a run writes, and its checkpoints.

`StepLog` streams steps.csv.partial (kept on a crash, truncated to the checkpoint's rows on resume);
`check_run_dir` refuses an --out that is a file or holds another configuration's run; `LoopState` is the
training loop's counters, and `save_checkpoint` / `resume` put them, with every component's state_dict and
the random generators, into a checkpoint (lab/run/checkpoint.py) and back.
"""
from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path

import torch

from lab.core import files, runfiles
from lab.core.config import RunConfig
from lab.run import checkpoint

STEP_FIELDS = ["step", "epoch", "loss", "scale", "found_inf", "skipped", "grad_norm", "lr", "precision",
               "first_nonfinite_layer", "first_nonfinite_source", "grad_amax",
               # a replayed overflow step's forward range: the first module whose output left FP16's range
               "forward_overflow_module", "forward_overflow_type", "forward_amax", "forward_weight_amax",
               # backward passes in the step (lab.record counts them; a lab run's accum_steps)
               "micro_batches"]


def forward_columns(forward: tuple[str, str, float, float] | None) -> dict:
    """steps.csv's forward-range columns from a monitor's ``last_forward`` (module, class, largest magnitude of its
    output and of its own weights)."""
    if forward is None:
        return {"forward_overflow_module": "", "forward_overflow_type": "", "forward_amax": "",
                "forward_weight_amax": ""}
    name, kind, amax, weight_amax = forward
    return {"forward_overflow_module": name, "forward_overflow_type": kind, "forward_amax": amax,
            "forward_weight_amax": weight_amax}


class StepLog:
    """Streams step rows to steps.csv.partial (kept on a crash) and publishes steps.csv at the end.

    ``keep_rows`` (a resumed run): the partial file keeps its header and that many rows, the ones the
    checkpoint accounts for; rows written after the checkpoint are dropped and will be written again."""

    def __init__(self, run_dir: Path, keep_rows: int | None = None):
        self.final = run_dir / "steps.csv"
        self.partial = run_dir / "steps.csv.partial"
        if keep_rows is not None:
            # whole lines only: a row the crash cut is not one the checkpoint accounts for
            lines = (runfiles.read_text(self.partial, live=True).splitlines(keepends=True)
                     if self.partial.is_file() else [])
            if len(lines) < keep_rows + 1:
                raise checkpoint.CheckpointError(
                    f"{self.partial} has {max(len(lines) - 1, 0)} rows, the checkpoint expects {keep_rows}")
            files.atomic_write_text(self.partial, "".join(lines[:keep_rows + 1]))
        self.file = open(self.partial, "w" if keep_rows is None else "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=STEP_FIELDS, lineterminator="\n")
        if keep_rows is None:
            self.writer.writeheader()

    def write(self, rows):
        self.writer.writerows(rows)
        self.file.flush()

    def publish(self):
        self.file.close()
        self.partial.replace(self.final)


class RunDirError(ValueError):
    """A run directory that cannot take this run; the message names the path and what was found."""


def check_run_dir(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse, before anything is written, a --out that is a file, cannot be written, or holds another
    configuration's run (its config.yaml, its metrics.json, or its checkpoint says whose)."""
    try:
        _check_writable(run_dir)
        recorded = run_dir / "config.yaml"
        started = any((run_dir / n).exists() for n in ("metrics.json", "steps.csv", "steps.csv.partial"))
        old = None
        if recorded.is_file() and started:
            try:
                old = RunConfig.from_dict(runfiles.read_yaml(recorded)).hash()
            except Exception:  # an older lab's config.yaml: its hash cannot be compared, so do not guess
                old = None
        elif (run_dir / "metrics.json").is_file():  # a finished run without its config.yaml: the hash it recorded
            try:
                old = runfiles.read_json(run_dir / "metrics.json").get("config_hash")
            except Exception:
                old = None
    except PermissionError as e:
        raise RunDirError(f"run directory {run_dir}: expected a folder this user can read and write; found "
                          f"{e.filename or run_dir} not accessible ({e.strerror})") from None
    if old is not None and old != cfg.hash():
        raise RunDirError(f"run directory {run_dir} holds a run of config {old}, this run is config "
                          f"{cfg.hash()}: use another --out, or delete the folder to replace it")
    latest = checkpoint.latest(run_dir)
    if latest is not None:  # a checkpoint of another configuration (or an unreadable one): refused now, not after
        checkpoint.load(latest, cfg.hash(), mmap=True)  # before config.yaml is rewritten (CheckpointError)


def _check_writable(run_dir: Path) -> None:
    """--out must be a folder, or a path where one can be made, that this user can write into."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir}: expected a folder, found a file")
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise RunDirError(f"run directory {run_dir}: expected a folder or a path where one can be made; found a "
                          f"file at {probe}")
    if not files.can_access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {run_dir}: expected a folder this user can write into; found {probe} "
                          f"not writable (mode {probe.stat().st_mode & 0o777:o})")


@dataclasses.dataclass
class LoopState:
    """The loop's counters: what a checkpoint keeps besides the components' state_dicts (lab/run/checkpoint.py)."""
    step: int = 0
    epoch: int = 0                 # the epoch in progress
    micro: int = 0                 # micro-batches of that epoch already trained on
    epoch_loader_rng: torch.Tensor | None = None  # the loader's generator at that epoch's start (its order)
    scales: list = dataclasses.field(default_factory=list)
    # distributed runs, per step (train.rank_decisions): 1 where this rank skipped it, the learning rate it stepped
    # at, 1 where its own gradients overflowed
    skips: list = dataclasses.field(default_factory=list)
    lrs: list = dataclasses.field(default_factory=list)
    own_found: list = dataclasses.field(default_factory=list)
    last_loss: float = float("nan")
    diverged_reason: str | None = None
    fallback_logged: bool = False
    train_time: float = 0.0
    samples: int = 0
    best_top1: float = 0.0
    top1: float = 0.0
    val_loss: float = float("nan")
    epochs_done: int = 0
    rows_written: int = 0          # rows of steps.csv.partial that belong to this state
    init_params_sha: str = ""
    first_batch_sha: str | None = None
    act_bytes: int = 0
    settle_overflows: int = 0      # train.settle_steps: overflow steps among the empty-gradient steps
    settle_time: float = 0.0       # and their seconds (train_time includes them)


def resume(path: Path, cfg: RunConfig, run_dir: Path, components: dict, rank: int = 0, world: int = 1):
    """Restore every component, the loop's counters and steps.csv.partial from a checkpoint.

    Distributed: every rank restores the same checkpoint and its own random generators; only rank 0's
    steps.csv.partial is cut back to the checkpoint's rows (the other ranks' step logs are throwaway).
    A checkpoint of another number of processes is refused on every rank alike (each rank's data shard and
    generators depend on it, so the run would not continue as it began)."""
    ck = checkpoint.load(path, cfg.hash())
    ranks = ck.get("rank_rng")
    if len(ranks or [None]) != world:
        raise checkpoint.CheckpointError(f"{path}: was written by a run of {len(ranks or [None])} process(es), "
                                         f"not {world}: resume with the same number of processes")
    for name, obj in components.items():
        obj.load_state_dict(ck[name])
    state = LoopState(**ck["loop"])
    steps_log = StepLog(run_dir, keep_rows=state.rows_written if rank == 0 else None)
    # last: restoring the components must not move a generator
    checkpoint.set_rng_state(ranks[rank] if ranks else ck["rng"])
    return state, steps_log


def save_checkpoint(cfg: RunConfig, run_dir: Path, components: dict, state: LoopState,
                    rank_rng: list | None = None) -> Path:
    """``rank_rng``: every rank's generator states (distributed runs; rank 0's are also ``rng``)."""
    ck = {name: obj.state_dict() for name, obj in components.items()}
    # str(): torch.__version__ is a TorchVersion, which weights_only=True does not load
    ck.update(config_hash=cfg.hash(), step=state.step, loop=dataclasses.asdict(state), rng=checkpoint.rng_state(),
              torch=str(torch.__version__))
    if rank_rng is not None:
        ck["rank_rng"] = rank_rng
    return checkpoint.save(run_dir, ck, keep=cfg.train.checkpoint_keep)

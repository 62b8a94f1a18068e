"""A workflow job: the seeds of one (model, mode), each trained in a child forked from one warm process.

A training process on a 2-core CPU spends 6-8 s before its first step (importing torch, then torch._dynamo, which
the first optimizer step imports, and timm) and 1-2 s tearing the interpreter down, against 10-25 s of training
per run of the default study. A job with several seeds (the study's `seeds_per_job`) imports once and forks one
child per seed: each child starts from the state a fresh process reaches after those imports, with nothing left
over from the seed before it (random generators, threads, autocast and registries are the child's own), and ends
with os._exit once its files are written. Signals a scheduler sends the job (SIGTERM, SIGUSR1) go on to the child
that is training, which checkpoints and stops; the job then stops too, with the child's exit status. A run that may
use CUDA starts in a fresh interpreter instead (``start_method``): CUDA does not survive a fork.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

from lab.core import files
from lab.run.checkpoint import RESUME_SIGNALS



def warm_imports() -> None:
    """What every run imports before its first step, imported once by the job (the children inherit it):
    torch._dynamo (torch.optim imports it at the first step), the training code, and timm (the image presets;
    a study of the lab's own models needs none)."""
    for name in ("torch._dynamo", "lab.run.train", "timm"):
        try:
            importlib.import_module(name)
        except ImportError:
            if name != "timm":
                raise


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


START_ENV = "LAB_JOB_START"  # fork | spawn: overrides start_method (tests/test_jobs.py; gpu_check.sh's rehearsal)


def start_method(devices: Iterable[str]) -> str:
    """How a job starts its runs: ``fork`` from this warm process for CPU runs; ``spawn``, a fresh interpreter per
    run, for any run that may use CUDA. The CUDA driver does not survive a fork once the parent has called it, and
    torch marks every child of a process that asked for the device count (``torch.cuda.is_available()`` does) unable
    to initialise CUDA; the parent cannot find out whether something it imported did so without calling the driver
    itself. A GPU run's seconds of imports are small beside its training; ``auto`` spawns on any CUDA build."""
    forced = os.environ.get(START_ENV)
    if forced:
        if forced not in ("fork", "spawn"):
            raise ValueError(f"{START_ENV}: expected fork or spawn; found {forced!r}")
        return forced
    import torch
    cuda_build = torch.cuda._is_compiled()  # torch's build, not the driver: calls nothing on the device
    return "spawn" if any(d.startswith("cuda") or (d == "auto" and cuda_build) for d in devices) else "fork"


def run_each(items: Iterable, train_one: Callable[[object], int], method: str = "fork") -> int:
    """train_one(item) in a child for each item in turn (``method``: forked from this process, or a fresh interpreter
    that unpickles train_one and the item); stops at the first non-zero exit status (a failed run, or a signal that
    interrupted one) and returns it; 0 when every child returned 0."""
    if method not in ("fork", "spawn"):
        raise ValueError(f"method: expected fork or spawn; found {method!r}")
    if method == "fork":
        warm_imports()
    state = {"child": None, "signum": None}

    def forward(signum, frame):
        state["signum"] = signum
        if state["child"] is not None:
            os.kill(state["child"], signum)

    old = {s: signal.signal(s, forward) for s in RESUME_SIGNALS}  # the signals a run checkpoints on
    try:
        for item in items:
            if state["signum"] is not None:  # asked to stop between two runs: the next one does not start
                return 128 + state["signum"]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = _start(method, train_one, item, old)
            state["child"] = pid
            if state["signum"] is not None:  # arrived between the start and the line above
                os.kill(pid, state["signum"])
            _, status = os.waitpid(pid, 0)
            state["child"] = None
            code = _exit_code(status)
            if code:
                return code
        return 128 + state["signum"] if state["signum"] is not None else 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _start(method: str, train_one, item, handlers) -> int:
    """The child's pid: forked (it runs the item and exits), or a fresh interpreter fed the pickled item."""
    if method == "fork":
        pid = os.fork()
        if pid == 0:
            _child(train_one, item, handlers)
        return pid
    proc = subprocess.Popen([sys.executable, "-c", "from lab.run.jobs import spawned; spawned()"],
                            stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((train_one, item)))
    proc.stdin.close()
    proc.returncode = 0  # reaped by run_each's waitpid: Popen must not wait for it again
    return proc.pid


def spawned() -> None:
    """A spawned child's main: the pickled (train_one, item) from standard input, then as a forked child (a fresh
    interpreter has the default signal handlers already)."""
    train_one, item = pickle.load(sys.stdin.buffer)
    _child(train_one, item, {})


def _child(train_one, item, handlers) -> None:
    """The forked child: its own signal handling, one run, then out without tearing the interpreter down."""
    for s, handler in handlers.items():
        signal.signal(s, handler)
    code = 1
    try:
        code = train_one(item)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  (reported like an uncaught exception, as a plain process would)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@contextmanager
def run_log(run_dir: str | Path):
    """Everything this process writes to stdout and stderr (Python's and C++'s) also goes to RUN_DIR/train.log,
    appended: the run folder keeps every attempt's lines, while the workflow empties its own log per attempt."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    log = open(run_dir / "train.log", "ab")

    def pump():
        while chunk := os.read(read_end, 65536):
            os.write(saved_out, chunk)
            log.write(chunk)
            log.flush()

    thread = threading.Thread(target=pump, name="run-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)  # the pipe's last write ends close: the pump reads to its end and stops
        os.dup2(saved_err, 2)
        thread.join()
        for fd in (read_end, saved_out, saved_err):
            os.close(fd)
        log.close()


def write_record(path: str | Path, model: str, mode: str, runs: list[tuple[int, Path, dict]]) -> None:
    """The job's record (its workflow output): each seed's run folder, status and config hash."""
    files.atomic_write_json(path, {"model": model, "mode": mode, "runs": [
        {"seed": seed, "run_dir": str(run_dir), "status": metrics.get("status"),
         "config_hash": metrics.get("config_hash")} for seed, run_dir, metrics in runs]})

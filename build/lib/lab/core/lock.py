"""One Snakemake study per folder, with a lock that dies with its process.

Snakemake's own directory lock is a file that stays behind after a ``kill -9`` (the next run then needs
``--unlock``). The lab's workflow profile (profiles/default) turns that lock off and the Snakefile's ``onstart``
calls :func:`hold` instead: an exclusive ``flock`` on a file under ``.snakemake/``, which the kernel releases
when the process ends, however it ends. A second ``snakemake`` in the same folder is refused before any job
starts, with the first one's PID. The same lock keeps two trainers out of one run directory (lab/run/train.py).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: dict[str, int] = {}  # path -> open descriptor, kept for the life of the process


class StudyLocked(RuntimeError):
    """Another process holds the study lock; the message names it."""


def hold(path: str | Path = ".snakemake/lab-study.lock", doing: str | None = None) -> None:
    """Take the lock at ``path`` for the rest of this process, or raise StudyLocked. ``doing`` says what the
    holder does (default: running a study in this folder); lab/run/train.py also locks each run directory."""
    path = Path(path)
    if str(path) in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        doing = doing or f"another snakemake (pid {holder}) is running a study in {Path.cwd()}"
        raise StudyLocked(f"{path}: {doing.format(pid=holder)}; wait for it to finish or stop it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[str(path)] = fd


def release(path: str | Path) -> None:
    """Give back a lock this process holds (a no-op otherwise)."""
    fd = _held.pop(str(Path(path)), None)
    if fd is not None:
        os.close(fd)

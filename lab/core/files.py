"""Run-directory I/O: atomic writes (a reader never sees half a file) and provenance."""
from __future__ import annotations

import csv
import io
import hashlib
import json
import math
import os
import platform
import secrets
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path`` (open for writing), with the mode the umask gives a new file.

    tempfile.mkstemp would create it 0600, and the rename would carry that over to the result: on a shared cluster a
    study only its author could read. Created here with os.open(..., 0o666), the kernel applies the umask in effect
    at that moment, as it does for any file the process creates (0644 under umask 022, 0600 under 077). Nothing
    reads the umask: os.umask(0) and back would change it for every thread meanwhile (racy), and a value read once
    at import would miss a later os.umask. O_EXCL with a random name makes the file ours alone, as mkstemp does;
    the folder is the target's, whose files are meant to be as readable as the result."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temporary file name for {path.name}")


def atomic_write(path: str | Path, write, mode: str = "w") -> None:
    """``write(f)`` into a temporary file in the same folder, then rename it over the target (atomic on
    POSIX): a crash or a kill leaves the old file or the new one, never half of one. The file gets the mode the
    umask gives a new file (0666 & ~umask), as a plain open() would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def can_access(path: str | Path, mode: int) -> bool:
    """os.access with the effective user ids where the platform has them (what opening the path would use)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))


def json_safe(obj):
    """``obj`` with every non-finite float as the string "nan", "inf" or "-inf" (JSON has no such numbers)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_yaml(path, obj) -> None:
    atomic_write_text(path, yaml.safe_dump(obj, sort_keys=False))


def atomic_write_csv(path, rows: list[dict], fieldnames: list[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def tensor_digest(tensors) -> str:
    """SHA-256 (first 16 hex digits) of tensors' dtypes, shapes and bytes: equal digests, equal tensors."""
    import torch
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


GIT_COMMIT_ENV = "LAB_GIT_COMMIT"  # the commit of a copy of the tree without .git (benchmarks/gpu/gpu_check.sh sets it)


def git_commit(repo_dir: Path | None = None) -> dict:
    """The repository's commit and whether tracked files differ from it; outside a repository, the commit
    ``LAB_GIT_COMMIT`` names (dirty unknown), else None."""
    repo_dir = repo_dir or Path(__file__).resolve().parents[2]
    named = {"commit": os.environ.get(GIT_COMMIT_ENV) or None, "dirty": None}

    def run(*args):
        return subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True, timeout=10)
    try:
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return named
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return named


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# /proc/cpuinfo flags that decide how a CPU computes FP16/BF16 (x86: avx512_fp16/amx_fp16 are FP16
# arithmetic, f16c only converts; ARM: fphp/asimdhp are FP16 arithmetic, bf16 the BF16 dot products)
LOW_PRECISION_FLAGS = ("f16c", "avx2", "avx512f", "avx512_fp16", "avx512_bf16", "amx_tile", "amx_bf16",
                       "amx_fp16", "fphp", "asimdhp", "bf16", "sve")


def cpu_info() -> dict:
    """The CPU model and its FP16/BF16 instruction support, as /proc/cpuinfo and torch report them."""
    import torch
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("flags", "Features"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    fp16 = sorted(f for f in ("avx512_fp16", "amx_fp16", "fphp", "asimdhp") if f in flags)
    bf16 = sorted(f for f in ("avx512_bf16", "amx_bf16", "bf16") if f in flags)
    return {"model": cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "fp16_arithmetic": fp16, "bf16_arithmetic": bf16,
            "flags": sorted(f for f in LOW_PRECISION_FLAGS if f in flags)}


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def package_versions() -> dict:
    from importlib import metadata
    versions = {"python": sys.version.split()[0]}
    for pkg in ("torch", "torchvision", "timm", "numpy", "pandas", "scikit-learn", "snakemake", "matplotlib"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    import lab
    versions["lab"] = lab.__version__
    return versions


def provenance(device: str, config_hash: str, started: str, extra: dict | None = None) -> dict:
    import torch
    info = {
        "versions": package_versions(),
        "device": device,
        "device_name": device_name(device),
        "cuda": torch.version.cuda if device.startswith("cuda") else None,
        "cpu": cpu_info(),
        "host": platform.node(),
        "platform": platform.platform(),
        "git": git_commit(),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "config_hash": config_hash,
        "start_time": started,
        "end_time": now_iso(),
    }
    info.update(extra or {})
    return info

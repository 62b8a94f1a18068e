"""``python -m lab inspect RUN_DIR [--follow]``: where a run stands, from what it has streamed to disk so far.

A lab run or a recording (lab/run/record.py) writes its steps to ``steps.csv.partial`` as it goes (every
``log_every`` steps) and publishes ``steps.csv`` and ``metrics.json`` at the end. This reads whichever is there and
says: the last step and its scale, the steps skipped so far and the update ratio, the current run of consecutive
skips and the longest, the last overflow and its first non-finite layer, the FP32 fallback if the run switched,
hand-set scales (``reset_scale``), and, once finished, the status. ``--follow`` prints a line each time new steps
arrive, until ``metrics.json`` appears.

Damaged files (lab/core/runfiles.py) are refused with InspectError, one line naming the file and line: a cut or
empty ``steps.csv`` or ``fp8_census.csv`` of a finished run, a ``metrics.json`` that is not a JSON object. A live
file (runfiles.is_live: ``steps.csv.partial``, the stream a running run appends to, or any file of a run without
``metrics.json`` yet) may end inside a line, the one being written: it is left out until it is whole, and a warning
says so.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from lab.core import runfiles

__all__ = ["InspectError", "inspect_run", "format_inspect", "follow"]


class InspectError(ValueError):
    """Not a run directory (no steps yet), or a damaged file in it: the message names the path."""


def _steps(run_dir: Path) -> tuple[list[dict], bool]:
    final, partial = run_dir / "steps.csv", run_dir / "steps.csv.partial"
    path = final if final.is_file() else partial if partial.is_file() else None
    if path is None:
        if not run_dir.is_dir():
            raise InspectError(f"{run_dir}: no such run directory")
        return [], False
    # the published file is whole (the stream renamed once complete); the stream may end inside a line
    _, rows = runfiles.read_csv(path, runfiles.STEP_COLUMNS, live=runfiles.is_live(path))
    return rows, path == final


def inspect_run(run_dir: str | Path) -> dict:
    """The run's state as a dict (see the module docstring); InspectError for a damaged file."""
    try:
        return _inspect(Path(run_dir))
    except runfiles.RunFileError as e:
        raise InspectError(str(e)) from None


def _inspect(run_dir: Path) -> dict:
    rows, published = _steps(run_dir)
    metrics = runfiles.read_json(run_dir / "metrics.json") if (run_dir / "metrics.json").is_file() else {}
    out = {"run_dir": str(run_dir), "finished": bool(metrics) and published, "status": metrics.get("status"),
           "steps": len(rows), "step": None, "scale": None, "skipped": 0, "update_ratio": None,
           "consecutive_skips": 0, "longest_skip_streak": 0, "overflow_steps": 0, "last_overflow_step": None,
           "last_overflow_layer": "", "fp32_fallback_step": None, "scale_resets": metrics.get("scale_resets", []),
           "alerts": metrics.get("alerts"), "loss": None}
    path = run_dir / ("steps.csv" if published else "steps.csv.partial")
    run = 0
    for r in rows:
        skipped, found = (runfiles.number(path, r, c, bool) for c in ("skipped", "found_inf"))
        out["skipped"] += skipped
        run = run + 1 if skipped else 0
        out["longest_skip_streak"] = max(out["longest_skip_streak"], run)
        if found:
            out["overflow_steps"] += 1
            out["last_overflow_step"] = runfiles.number(path, r, "step", int)
            layer, source = r.get("first_nonfinite_layer") or "", r.get("first_nonfinite_source") or ""
            out["last_overflow_layer"] = f"{layer} ({source})" if layer and source else layer
        if out["fp32_fallback_step"] is None and r.get("precision") == "fp32" and rows[0].get("precision") == "fp16":
            out["fp32_fallback_step"] = runfiles.number(path, r, "step", int)
    if rows:
        last = rows[-1]
        out.update(step=runfiles.number(path, last, "step", int), scale=runfiles.number(path, last, "scale"),
                   consecutive_skips=run, update_ratio=(len(rows) - out["skipped"]) / len(rows),
                   loss=runfiles.number(path, last, "loss"))
    out["fp8"] = _fp8(run_dir)
    return out


def _fp8(run_dir: Path) -> dict | None:
    """An FP8 run's latest census step (fp8_census.csv, written when the run ends): per tensor kind, the shares
    saturated and flushed."""
    from lab.diagnose.fp8 import _shares
    from lab.fp8.census import read_rows
    rows = read_rows(run_dir)
    if not rows:
        return None
    last = max(r["step"] for r in rows)
    return {"step": last, "shares": _shares([r for r in rows if r["step"] == last])}


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isfinite(v) and v > 0 and math.log2(v).is_integer():
        return f"2^{int(math.log2(v))}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_inspect(s: dict) -> str:
    """One line: the state of the run."""
    if not s["steps"]:
        return f"{s['run_dir']}: no step recorded yet"
    parts = [f"step {s['step']}", f"scale {_num(s['scale'])}", f"loss {_num(s['loss'])}",
             f"skipped {s['skipped']}/{s['steps']} (update ratio {s['update_ratio']:.3f})",
             f"consecutive skips {s['consecutive_skips']} (longest {s['longest_skip_streak']})"]
    if s["last_overflow_step"] is not None:
        parts.append(f"last overflow step {s['last_overflow_step']}"
                     + (f" at {s['last_overflow_layer']}" if s["last_overflow_layer"] else ""))
    if s["fp32_fallback_step"] is not None:
        parts.append(f"FP32 fallback from step {s['fp32_fallback_step']}")
    if s["alerts"]:
        parts.append(f"alerts {s['alerts']}")
    if s["scale_resets"]:
        parts.append("scale set by hand: " + ", ".join(f"{_num(r['from'])} -> {_num(r['to'])} at update "
                                                        f"{r['update']}" for r in s["scale_resets"]))
    if s.get("fp8"):
        parts.append(f"FP8 census step {s['fp8']['step']}: " + ", ".join(
            f"{kind} {100 * v['saturated']:.3g}% saturated {100 * v['flushed']:.3g}% flushed"
            for kind, v in s["fp8"]["shares"].items()))
    parts.append(f"finished, status {s['status']}" if s["finished"] else "running (or stopped before the end)")
    return "; ".join(parts)


def follow(run_dir: str | Path, interval: float = 2.0, printer=print, max_wait: float | None = None) -> dict:
    """Print a line whenever new steps arrive, until the run is finished (or ``max_wait`` seconds pass). A file's
    incomplete last line is said once, not at every poll that finds it still being written."""
    seen, start = -1, time.monotonic()
    said = _Once()
    logging.getLogger("lab.core.runfiles").addFilter(said)
    try:
        while True:
            s = inspect_run(run_dir)
            if s["steps"] != seen or s["finished"]:
                printer(format_inspect(s))
                seen = s["steps"]
            if s["finished"] or (max_wait is not None and time.monotonic() - start > max_wait):
                return s
            time.sleep(interval)
    finally:
        logging.getLogger("lab.core.runfiles").removeFilter(said)


class _Once(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True

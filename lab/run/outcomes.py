"""Per-example outcomes of a run's final evaluation: ``outcomes.npz`` in the run directory.

Top-1 on 360 digits moves in steps of one image, and the validation set is itself a sample: a comparison of two
modes must count the examples as a source of variance, not only the seeds (lab/study/inference.py). So each
evaluation writes, in the validation loader's order, one row per scored example (an image, or a next token of
the LM): ``correct`` (bool), ``loss`` (float32, nats) and ``unit`` (int32), the independent unit the example
belongs to. Images are independent of each other (unit = the image); the LM's next tokens are not: tokens of one
document share its topic and vocabulary, so its unit is the document (24 in the default study's validation split).
Token files (prepare-text) keep no document boundaries: there the unit is the context window, which treats
neighbouring windows as independent (an approximation the statistics note states).

The file is rewritten after every evaluation (atomically), so after the last epoch it holds the final one, and
a resumed run rewrites it from the same weights. metrics.json records its SHA-256 (``outcomes``).
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from lab.core import files, runfiles

FILENAME = "outcomes.npz"
UNIT_NAMES = ("image", "document", "window")


def write(run_dir, correct, loss, unit, unit_name: str) -> dict:
    """Write outcomes.npz atomically; returns its metrics.json record (file, sha256, examples, units, unit)."""
    correct, loss, unit = np.asarray(correct, bool), np.asarray(loss, np.float32), np.asarray(unit, np.int32)
    if not len(correct) == len(loss) == len(unit):
        raise ValueError(f"outcomes: correct, loss and unit must have one entry per example; found "
                         f"{len(correct)}, {len(loss)} and {len(unit)}")
    if unit_name not in UNIT_NAMES:
        raise ValueError(f"outcomes: unit must be one of {', '.join(UNIT_NAMES)}; found {unit_name!r}")
    buf = io.BytesIO()
    np.savez_compressed(buf, correct=correct, loss=loss, unit=unit, unit_name=np.array(unit_name))
    data = buf.getvalue()
    files.atomic_write(Path(run_dir) / FILENAME, lambda f: f.write(data), mode="wb")
    return _record(data, correct, unit, unit_name)


def _record(data: bytes, correct, unit, unit_name: str) -> dict:
    return {"file": FILENAME, "sha256": hashlib.sha256(data).hexdigest(), "examples": int(len(correct)),
            "units": int(len(np.unique(unit))), "unit": unit_name}


def record(run_dir) -> dict | None:
    """The metrics.json record of the run's outcomes file (None when it has none)."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return None
    o = read(run_dir)
    return _record(path.read_bytes(), o["correct"], o["unit"], o["unit_name"])


def read(run_dir) -> dict | None:
    """{correct, loss, unit, unit_name} of a run, or None when the run has no outcomes file (older runs)."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return None
    z = runfiles.read_arrays(path)  # RunFileError naming the file when it is cut or damaged
    try:
        return {"correct": z["correct"].astype(bool), "loss": z["loss"].astype(np.float64),
                "unit": z["unit"].astype(np.int64), "unit_name": str(z["unit_name"])}
    except KeyError as e:
        raise runfiles.RunFileError(f"{path}: no array {e} (not an outcomes file the lab wrote)") from None


def units_for(bundle, n_examples: int) -> tuple[np.ndarray, str]:
    """The independent unit of each scored example of ``bundle.val`` (see the module docstring)."""
    if bundle.task != "lm":  # an image, or the image a question is about (digits-vqa: four per image)
        units = getattr(bundle.val, "units", None)
        return (np.arange(n_examples) if units is None else np.asarray(units)[:n_examples]), "image"
    starts = getattr(bundle.val, "doc_starts", None)
    if starts is None:  # token files: no document boundaries
        return np.arange(n_examples) // max(bundle.input_size, 1), "window"
    # the j-th scored token is the stream's token j + 1 (TokenWindows: targets are the inputs shifted by one)
    positions = np.arange(1, n_examples + 1)
    return np.searchsorted(np.asarray(starts), positions, side="right") - 1, "document"

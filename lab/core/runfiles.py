"""Reading a run directory's files: one reader per format, each refusing a damaged file in one line.

A run directory may have been copied, synced half-way or damaged on disk. Every command that reads one (``lab
inspect``, ``diagnose``, ``replay``, ``figures``, ``aggregate``, ...) reads its files through here, so a damaged
file gives the same answer everywhere: a ``RunFileError`` whose message is one line naming the file, and the line
where that is known; the command line prints it and exits with status 2 (lab/cli.py).

What counts as damage:

* an empty file (the lab never writes one: a CSV has at least its header, JSON an object, YAML a mapping);
* bytes that are not UTF-8 text, or NUL bytes (binary data; a file a crash left zero-filled);
* a last line without its end of line: every file the lab writes ends with one, so a file that stops inside a
  line was cut (copied while being written, truncated). A cut CSV or YAML line often still parses, into wrong
  values, so this is the only sign of it. JSON is exempt: a cut JSON text does not parse, and JSON written by
  hand or by other tools often ends without a newline;
* what the format does not allow: a CSV row with more or fewer fields than the header, a header without the
  required columns, invalid JSON or YAML, JSON that is not an object, YAML that is not a mapping.

The exception: a live file (``live=True``), one that may still be being written. Its last line may be half-written
by design: it is left out, and said (a warning on the ``lab.core.runfiles`` logger, which the command line prints
on stderr, naming the file and the line), and an empty live file is one with nothing flushed yet. Damage anywhere
else in a live file is refused as in any other. Which files are live (:func:`is_live`, the one place that decides):

* ``steps.csv.partial``, the step stream a run appends to while it trains (and keeps if it crashes), always;
* every file of a run that has no ``metrics.json`` yet: a run writes ``metrics.json`` last, when it ends (lab
  runs, recordings, RL and DPO runs alike), so until then its files are a live run's, read by ``lab inspect
  [--follow]`` while they are written or copied.

Once ``metrics.json`` is there the run is finished and its files are whole: a cut last line is damage (published
files: ``steps.csv`` is the stream renamed once complete). A reader of a run's file asks ``is_live(path)``; a reader of a
study's tables (outside any run directory, never being written: atomic) does not ask, and passes ``live=False``.

A missing file is the caller's business: some are optional (``census.csv`` of a run without a census, a run's
``config.yaml``), some required; these readers are called on a file that exists.

What was read: inside ``with recording() as read:``, every file these readers read adds its path and the SHA-256 of
the bytes read to ``read``: the provenance of a result computed from run files (a fitted scale model's,
lab/scaling/learning/histories.py) is then what was read, not a list kept beside the readers.
"""
from __future__ import annotations

import contextlib
import contextvars
import csv
import hashlib
import io
import json
import logging
from pathlib import Path

import yaml

__all__ = ["RunFileError", "is_live", "recording", "read_text", "read_json", "read_yaml", "read_csv", "read_csv_frame",
           "read_tensors", "read_arrays", "number", "STEP_COLUMNS", "CENSUS_COLUMNS"]

log = logging.getLogger(__name__)

#: columns every steps.csv has (lab runs and recordings, since the first version); a reader that needs others
#: asks for them
STEP_COLUMNS = ("step", "loss", "scale", "found_inf", "skipped")
#: columns every census.csv has
CENSUS_COLUMNS = ("step", "scale", "source", "layer", "at_scale", "total", "zero", "underflow", "subnormal",
                  "normal", "overflow")


#: the open ``recording()`` blocks' records, innermost last: a file read inside nested blocks is in each
_RECORDS: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar("runfiles_records", default=())


@contextlib.contextmanager
def recording():
    """Yields a dict that every file read inside the block adds to: {path as given: SHA-256 of its bytes as read}
    (module docstring). A file read twice holds its last reading's digest."""
    record: dict[str, str] = {}
    token = _RECORDS.set(_RECORDS.get() + (record,))
    try:
        yield record
    finally:
        _RECORDS.reset(token)


def _note(path: Path, data: bytes) -> None:
    records = _RECORDS.get()
    if records:
        digest = hashlib.sha256(data).hexdigest()
        for record in records:
            record[str(path)] = digest


def is_live(path: str | Path) -> bool:
    """Whether a run's file may end inside its last line (module docstring): the step stream, or any file of a run
    with no metrics.json yet (the file's folder is the run directory)."""
    path = Path(path)
    return path.name.endswith(".partial") or not (path.parent / "metrics.json").exists()


class RunFileError(ValueError):
    """A run directory's file that is damaged or not what the lab writes there; the message (one line) names
    the file, and the line where that is known."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def read_text(path: str | Path, live: bool = False, whole_lines: bool = True) -> str:
    """The file as text, refused (RunFileError) when empty, not UTF-8, holding NUL bytes, or (``whole_lines``)
    ending inside a line; ``live``: an empty file is "" and a last line without its end is dropped."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunFileError(f"{path}: cannot read ({e.strerror or e})") from None
    _note(path, data)
    if not data:
        if live:
            return ""
        raise RunFileError(f"{path}: empty file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise RunFileError(f"{path}, line {line}: not text (byte 0x{data[e.start]:02x} at offset {e.start} is not "
                           "UTF-8): a binary or damaged file") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise RunFileError(f"{path}, line {text.count(chr(10), 0, nul) + 1}: holds NUL bytes: a binary file, or one "
                           "a crash left zero-filled")
    if whole_lines and not text.endswith("\n"):
        if live:  # the line being written: not there yet, left out and said (a cut value would read as another)
            log.warning("%s, line %d: incomplete last line left out (the run is still being written)", path,
                        text.count("\n") + 1)
            return text[:text.rfind("\n") + 1]
        raise RunFileError(f"{path}, line {text.count(chr(10)) + 1}: cut short (the file ends inside this line: "
                           "truncated, or copied while it was being written)")
    return text


def read_json(path: str | Path) -> dict:
    """A JSON object (metrics.json, provenance.json); RunFileError when damaged (see the module docstring)."""
    path = Path(path)
    text = read_text(path, whole_lines=False)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFileError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise RunFileError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping (config.yaml); RunFileError when damaged (see the module docstring)."""
    path = Path(path)
    text = read_text(path)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or getattr(e, "context", None) or e
        raise RunFileError(f"{path}{where}: not valid YAML ({_one_line(what)})") from None
    if not isinstance(value, dict):
        raise RunFileError(f"{path}: expected a YAML mapping, found {type(value).__name__}")
    return value


def _csv(path: Path, required: tuple, live: bool, as_dicts: bool) -> tuple[str, list[str], list[dict]]:
    """The checked text, the header and (``as_dicts``) the rows; csv.reader, not DictReader: a third of the time."""
    text = read_text(path, live=live)
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[dict] = []
    try:
        columns = next(reader, None)
        while columns == []:  # blank lines before the header, skipped as csv.DictReader does
            columns = next(reader, None)
        if not columns:
            if live:  # nothing flushed yet
                return "", [], rows
            raise RunFileError(f"{path}: no CSV header" + (f", expected one with {', '.join(required)}"
                                                           if required else ""))
        missing = [c for c in required if c not in columns]
        if missing:
            raise RunFileError(f"{path}: missing column(s) {', '.join(missing)}; found "
                               f"{_one_line(', '.join(columns))[:200]}")
        n = len(columns)
        for row in reader:
            if len(row) != n:
                if not row:  # a blank line
                    continue
                raise RunFileError(f"{path}, line {reader.line_num}: {len(row)} field(s), the header has {n}")
            if as_dicts:
                d = dict(zip(columns, row))
                d["_line"] = reader.line_num
                rows.append(d)
    except csv.Error as e:
        raise RunFileError(f"{path}, line {reader.line_num}: not valid CSV ({_one_line(e)})") from None
    return text, columns, rows


def read_csv(path: str | Path, required=(), live: bool = False) -> tuple[list[str], list[dict]]:
    """(columns, rows) of a CSV file with at least the ``required`` columns, every row as a dict of strings plus
    ``_line`` (its line in the file, for messages); RunFileError when damaged (see the module docstring)."""
    _, columns, rows = _csv(Path(path), tuple(required), live, as_dicts=True)
    return columns, rows


def read_csv_frame(path: str | Path, required=(), live: bool = False, **read_csv_kwargs):
    """The same file, checked the same way, as a pandas DataFrame (``pandas.read_csv``'s types and options)."""
    import pandas as pd
    text, columns, _ = _csv(Path(path), tuple(required), live, as_dicts=False)
    if not columns:
        return pd.DataFrame()
    return pd.read_csv(io.StringIO(text), **read_csv_kwargs)


def read_tensors(path: str | Path, **load_kwargs):
    """A run's tensors file (fp8_operands.pt, weights.pt) through ``torch.load(weights_only=True)``: tensors and
    plain containers, nothing run; RunFileError naming the file when it does not load."""
    import torch
    return _binary(Path(path), lambda p: torch.load(p, weights_only=True, **load_kwargs), "tensors")


def read_arrays(path: str | Path) -> dict:
    """A run's .npz file (outcomes.npz) as {name: array}, no pickles; RunFileError naming the file when it does not
    load."""
    import numpy as np

    def load(p):
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}  # read now: a lazy array would fail later, far from the file's name
    return _binary(Path(path), load, "NumPy arrays")


def _binary(path: Path, load, what: str):
    """``load(path)``, any failure a RunFileError naming the file: a binary file has no lines, so it is whole or
    damaged, live or not (the lab writes these atomically)."""
    try:
        if not path.stat().st_size:
            raise RunFileError(f"{path}: empty file")
        if _RECORDS.get():  # its loader opens it: the bytes read again for the record only while one is open
            _note(path, path.read_bytes())
        return load(path)
    except RunFileError:
        raise
    except Exception as e:  # whatever the loader raises on these bytes (zip, pickle, EOF, OS errors) is the file's
        why = _one_line(e).split(". ")[0][:200]  # the loader's first sentence: torch's go on with advice
        raise RunFileError(f"{path}: does not load as {what} ({why}): truncated or damaged") from None


def number(path: str | Path, row: dict, column: str, kind=float):
    """``row[column]`` (a row of read_csv) as ``kind``: float, int (a float that is whole: "3.0" is 3) or bool
    (1/0, true/false); RunFileError naming the file, line and column otherwise."""
    raw = (row.get(column) or "").strip()
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "1.0"):
                return True
            if raw.lower() in ("0", "false", "0.0"):
                return False
            raise ValueError
        if kind is int:
            value = float(raw)
            if not value.is_integer():
                raise ValueError
            return int(value)
        return float(raw)
    except ValueError:
        raise RunFileError(f"{path}, line {row.get('_line', '?')}: column {column!r} holds {raw[:40]!r}, "
                           f"expected {'0/1' if kind is bool else kind.__name__}") from None

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

The exception: ``live=True``, for ``steps.csv.partial``, the step stream a run appends to while it trains (and
keeps if it crashes). Its last line may be half-written by design: it is dropped, as is an empty file (no step
flushed yet). Published files (``steps.csv`` is the stream renamed once complete) are never live.

A missing file is the caller's business: some are optional (``census.csv`` of a run without a census, a run's
``config.yaml``), some required; these readers are called on a file that exists.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import yaml

__all__ = ["RunFileError", "read_text", "read_json", "read_yaml", "read_csv", "read_csv_frame", "number",
           "STEP_COLUMNS", "CENSUS_COLUMNS"]

#: columns every steps.csv has (lab runs and recordings, since the first version); a reader that needs others
#: asks for them
STEP_COLUMNS = ("step", "loss", "scale", "found_inf", "skipped")
#: columns every census.csv has
CENSUS_COLUMNS = ("step", "scale", "source", "layer", "at_scale", "total", "zero", "underflow", "subnormal",
                  "normal", "overflow")


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
        if live:  # the line being written: not there yet
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

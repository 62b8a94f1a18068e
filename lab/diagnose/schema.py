"""The JSON Schema of ``lab diagnose --json``, generated from the record's dataclasses (lab/diagnose/record.py).

One declaration: each field's type comes from its annotation and its description from the comment beside it, so the
schema cannot drift from what ``format_json`` prints. ``python -m lab diagnose --schema`` prints it; the committed
copy, docs/diagnose.schema.json, is checked against this by tests/test_diagnose_schema.py, which also validates real
diagnoses against it.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing

from lab.diagnose.record import SEVERITIES, Diagnosis, Finding, Recommendation

SCHEMA_ID = "https://loss-scale-lab/schemas/diagnose.schema.json"
# files.json_safe writes non-finite floats as these strings: a number field may hold one
NON_FINITE = {"type": "string", "enum": ["inf", "-inf", "nan"]}
CODE = {"type": "string", "pattern": "^[a-z0-9_]+$", "description": "a stable identifier (docs/diagnose.md's catalogue)"}
WITHHELD = {"type": "object", "required": ["code", "action", "reason"], "additionalProperties": False,
            "properties": {"code": {**CODE, "description": "a recommendation's code"}, "action": {"type": "string", "description": "the advice"},
                           "reason": {"type": "string", "description": "the evidence against it"}},
            "description": "advice the run's evidence contradicts, and why"}


def codes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({finding code: the modules that give it}, {recommendation code: ...}), read from the rules' source
    (lab/diagnose/*.py: every ``b.find(CODE, ...)``, ``b.recommend(CODE, ...)``, ``Recommendation(CODE, ...)``
    and fp8.py's ``code, change = CODE, ...`` with CODE a string literal): the schema's enums and docs/diagnose.md's
    list of codes, so a new rule's code is in both without a hand-kept list."""
    from pathlib import Path
    found: dict[str, set] = {}
    advised: dict[str, set] = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        text = path.read_text()
        for code in re.findall(r'\.find\(\s*"([a-z0-9_]+)"', text):
            found.setdefault(code, set()).add(path.stem)
        for code in re.findall(r'(?:\.recommend|Recommendation)\(\s*"([a-z0-9_]+)"|code, change = "([a-z0-9_]+)"',
                               text):
            advised.setdefault(code[0] or code[1], set()).add(path.stem)
    return ({c: sorted(m) for c, m in sorted(found.items())}, {c: sorted(m) for c, m in sorted(advised.items())})


def _comments(cls) -> dict[str, str]:
    """field -> the comment beside it (and the comment lines right under it)."""
    out, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^#]*?(?:#\s*(.*))?$", line)
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            last = m.group(1)
            if m.group(2):
                out[last] = m.group(2).strip()
        elif last and re.match(r"\s+#\s*(.*)$", line) and last in out:
            out[last] += " " + line.strip().lstrip("#").strip()
        else:
            last = None
    return out


def _type(tp) -> dict:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return {"anyOf": [_type(a) for a in typing.get_args(tp)]}
    if tp is type(None):
        return {"type": "null"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"anyOf": [{"type": "number"}, NON_FINITE]}
    if tp is str:
        return {"type": "string"}
    if tp in (list, dict):
        return {"type": "array" if tp is list else "object"}
    raise TypeError(f"no JSON type for {tp!r}")


def _object(cls, special: dict) -> dict:
    hints, notes = typing.get_type_hints(cls), _comments(cls)
    props = {}
    for f in dataclasses.fields(cls):
        props[f.name] = dict(special.get(f.name) or _type(hints[f.name]))
        if f.name in notes:
            props[f.name].setdefault("description", notes[f.name])
    return {"type": "object", "required": [f.name for f in dataclasses.fields(cls)], "additionalProperties": False,
            "properties": props, "description": (cls.__doc__ or "").strip() or cls.__name__}


def json_schema() -> dict:
    """The schema of ``Diagnosis.to_dict()`` (draft 2020-12)."""
    found, advised = codes()
    finding_code = {**CODE, "enum": list(found)}
    rec_code = {**CODE, "enum": list(advised)}
    finding = _object(Finding, {"code": finding_code, "severity": {"type": "string", "enum": list(SEVERITIES)}})
    rec = _object(Recommendation, {"code": rec_code, "based_on": {"type": "array", "items": finding_code}})
    diagnosis = _object(Diagnosis, {
        "verdict": {"type": "string", "enum": ["healthy", "issues", "diverged", "failed"]},
        "findings": {"type": "array", "items": {"$ref": "#/$defs/finding"}},
        "recommendations": {"type": "array", "items": {"$ref": "#/$defs/recommendation"},
                            "description": "ranked by the evidence, first the one to try first"},
        "withheld": {"type": "array", "items": {"$ref": "#/$defs/withheld"}},
        "notes": {"type": "array", "items": {"type": "string"}}})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "lab diagnose --json", **diagnosis,
            "$defs": {"finding": finding, "recommendation": rec, "withheld": WITHHELD}}

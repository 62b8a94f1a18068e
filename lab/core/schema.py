"""The study schema (lab/core/schemas/config.schema.yaml) and its refusals: one line per problem, naming the key,
what the schema expects there and what the config holds."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from lab.core.errors import ConfigError, did_you_mean

SCHEMA_PATH = Path(__file__).parent / "schemas" / "config.schema.yaml"

_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "a mapping", "null": "null"}
_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _key_path(parts) -> str:
    """train.faults[0].step: keys joined by dots, list positions in brackets."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def format_schema_error(err: jsonschema.ValidationError, prefix: str = "") -> str:
    """One line: the key, what the schema expects there and what the config holds."""
    where = prefix + _key_path(err.absolute_path) or "<top level>"
    v, value, found = err.validator, err.validator_value, err.instance
    if v == "additionalProperties" and isinstance(err.schema.get("properties"), dict):
        allowed = sorted(err.schema["properties"])
        extra = sorted(set(found) - set(allowed))
        hints = "".join(did_you_mean(k, allowed) for k in extra[:1])
        return (f"{where}: unknown key(s) {', '.join(map(repr, extra))}{hints}; "
                f"allowed keys: {', '.join(allowed)}")
    if v == "enum":
        return (f"{where}: expected one of {', '.join(map(str, value))}; found {found!r}"
                f"{did_you_mean(found, value)}")
    if v == "type":
        types = [value] if isinstance(value, str) else list(value)
        return f"{where}: expected {' or '.join(_TYPE_WORDS.get(t, t) for t in types)}; found {found!r}"
    if v in _BOUNDS:
        return f"{where}: expected a value {_BOUNDS[v]} {value}; found {found!r}"
    if v == "uniqueItems":
        repeated = sorted({repr(x) for i, x in enumerate(found) if x in found[:i]})
        return f"{where}: expected distinct values; found {', '.join(repeated)} more than once in {found!r}"
    if v in ("minItems", "minProperties"):
        return f"{where}: expected at least {value} entr{'y' if value == 1 else 'ies'}; found {len(found)}"
    if v == "required":
        missing = [k for k in value if isinstance(found, dict) and k not in found]
        return f"{where}: expected the key(s) {', '.join(map(repr, missing))}; found only {sorted(found)}"
    return f"{where}: {err.message}"


def _is_integer(checker, instance) -> bool:
    """A YAML integer: 2, not 2.0 (which JSON Schema counts as one, and range() refuses) nor true."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def schema_errors(schema: dict, instance, prefix: str = "") -> list[str]:
    errors = sorted(_Validator(schema).iter_errors(instance), key=lambda e: [str(p) for p in e.path])
    return [format_schema_error(e, prefix) for e in errors]


def invalid(problems: list[str]) -> ConfigError:
    """One line, however many problems: the CLI prints it as the single line of a refusal."""
    return ConfigError("invalid configuration: " + "; ".join(problems))


def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())

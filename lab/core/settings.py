"""Settings checked from one declaration: the keyword arguments of a registered function or class (a recipe, a
predictor, a loss-scaling policy), their annotations and, for a number with one, a declared range
(``Annotated[float, Range(ge=0)]``). A config's misspelt key gets a did-you-mean and a wrong value one line naming
the owner, the key and what was expected, before anything is built. Pure Python: validation imports no torch."""
from __future__ import annotations

import inspect
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from lab.core.errors import ConfigError, did_you_mean

__all__ = ["Range", "declared_settings", "check_settings", "describe", "doc", "parse_spec", "spec_dict"]


@dataclass(frozen=True)
class Range:
    """A number's allowed interval, declared in its annotation: ``Annotated[int, Range(ge=1)]``."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, v) -> bool:
        # the bounds' own comparisons, so that NaN fails every one of them
        tests = ((self.ge, lambda: v >= self.ge), (self.gt, lambda: v > self.gt),
                 (self.le, lambda: v <= self.le), (self.lt, lambda: v < self.lt))
        return all(test() for bound, test in tests if bound is not None)

    def __str__(self) -> str:
        low = "[" if self.ge is not None else "(" if self.gt is not None else None
        high = "]" if self.le is not None else ")" if self.lt is not None else None
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if low and high:
            return f"in {low}{lo:g}, {hi:g}{high}"
        if low:
            return f"{'>=' if low == '[' else '>'} {lo:g}"
        return f"{'<=' if high == ']' else '<'} {hi:g}"


def declared_settings(fn) -> tuple[dict[str, Any], bool]:
    """({setting: annotation (Any where none)}, whether fn also takes **kwargs) of a function or a class's
    __init__, ``self`` left out."""
    target = fn.__init__ if isinstance(fn, type) else fn
    if target is object.__init__:
        return {}, False
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError):  # a user's annotation that names what only a type checker imports: unchecked
        hints = {}
    params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    named = {p.name: hints.get(p.name, Any) for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


_NAMES = {int: "an int", float: "a real number", str: "a string", bool: "a bool", dict: "a mapping",
          type(None): "null"}


def _expected(value, kind) -> str | None:
    """None where value is a `kind`; else what a `kind` is, in words (the message's expectation)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return None
    if origin is Annotated:
        wrong = _expected(value, args[0])
        if wrong:
            return wrong
        return next((str(r) for r in args[1:] if isinstance(r, Range) and not r.holds(value)), None)
    if origin in (Union, types.UnionType):
        wrongs = [_expected(value, a) for a in args]
        if None in wrongs:
            return None
        # "or null" left out where there is something else to say: a default, not what a config means to give
        return " or ".join(w for w, a in zip(wrongs, args) if a is not type(None)) or "null"
    if origin is Literal:
        # type as well as value: YAML's true is not a setting's 1
        fits = any(value == a and type(value) is type(a) for a in args)
        return None if fits else "one of " + ", ".join(str(a) for a in args)
    if origin in (list, tuple):
        items = args[0] if args else Any
        ok = isinstance(value, (list, tuple)) and all(_expected(v, items) is None for v in value)
        return None if ok else f"a list of {_NAMES.get(items, str(items)).split(' ', 1)[-1]}s"
    return _scalar(value, kind)


def _scalar(value, kind) -> str | None:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return None if math.isfinite(value) else "finite"
        ok = False
    elif isinstance(kind, type):
        ok = isinstance(value, kind)
    else:  # an annotation this checker does not read (Callable, Sequence[...]): the setting's own code checks it
        return None
    return None if ok else _NAMES.get(kind, getattr(kind, "__name__", str(kind)))


def check_settings(what: str, declared: dict[str, Any], params: dict, error=ConfigError,
                   var_kw: bool = False) -> None:
    """Refuse a setting `declared` (declared_settings) does not name, with a did-you-mean, or whose value does not
    fit its annotation: one line, `what` (e.g. "recipe 'nvfp4'") first, then the key and what was expected."""
    for key, value in params.items():
        if key not in declared:
            if var_kw:
                continue
            raise error(f"{what}: unknown setting {key!r}{did_you_mean(key, declared)}; settings: "
                        f"{', '.join(declared) or '(none)'}")
        wrong = _expected(value, declared[key])
        if wrong:
            hint = did_you_mean(value, typing.get_args(_literal(declared[key]))) if isinstance(value, str) else ""
            raise error(f"{what}: {key} must be {wrong}, got {value!r}{hint}")


def _literal(kind):
    """The Literal inside an annotation (Annotated, Optional), for the did-you-mean of a misspelt choice."""
    if typing.get_origin(kind) is Literal:
        return kind
    return next((lit for a in typing.get_args(kind) if (lit := _literal(a)) is not None), None)


def describe(kind) -> str:
    """An annotation in a reader's words (the docs' settings tables): `e4m3 | e5m2`, `float >= 0`, `list of str`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return "any"
    if origin is Annotated:
        return " ".join([describe(args[0]), *(str(r) for r in args[1:] if isinstance(r, Range))])
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)  # escaped: the docs' tables are Markdown
    if origin in (list, tuple):
        return f"list of {describe(args[0]) if args else 'any'}"
    return "null" if kind is type(None) else getattr(kind, "__name__", str(kind))


def doc(kind) -> str:
    """A setting's description: the string in its annotation (``Annotated[float, Range(ge=0), "what it does"]``)."""
    if typing.get_origin(kind) is Annotated:
        return next((a for a in typing.get_args(kind)[1:] if isinstance(a, str)), "")
    return ""


def spec_dict(spec) -> dict | None:
    """A config's spec as {name, **settings}: a name alone, or a mapping with a name; None for anything else (a run
    that names none)."""
    if isinstance(spec, str):
        return {"name": spec}
    return dict(spec) if isinstance(spec, dict) and spec.get("name") else None


def parse_spec(spec, what: str) -> tuple[str, dict]:
    """A registered thing's spec (a predictor, a recipe, a policy) as (name, settings): ``"NAME"``,
    ``"NAME:KEY=VALUE,..."`` (values read as YAML: 1000, 2.0e-3, true, [a, b]) or ``{"name": NAME, **settings}``;
    `what` names it in the one-line error."""
    if isinstance(spec, dict):
        params = dict(spec)
        return str(params.pop("name", None)), params
    if not isinstance(spec, str):
        raise ConfigError(f"a {what} is a name or {{name: ..., settings}}, got {spec!r}")
    import yaml
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{what} {spec!r}: expected NAME:KEY=VALUE,..., got {item!r}")
        params[key.strip()] = yaml.safe_load(value)
    return name.strip(), params

"""The docs' reference tables, generated from the declarations they describe, so that a doc cannot drift from the
code: a section of a docs/*.md file between ``<!-- generated:NAME -->`` and ``<!-- generated:end -->`` is
``SECTIONS[NAME]()``. ``python -m lab docs-tables`` rewrites them; ``--check`` (tests/test_reference_docs.py) says
which are stale.
"""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _columns_table(docs: dict[str, str]) -> str:
    rows = [f"| `{name}` | {text} |" for name, text in docs.items()]
    return "\n".join(["| column | what it holds |", "|---|---|", *rows])


def fp8_census_columns() -> str:
    from lab.fp8.census import COLUMN_DOCS
    return _columns_table(COLUMN_DOCS)


def fp8_amax_columns() -> str:
    from lab.fp8.amax_record import COLUMN_DOCS
    return _columns_table(COLUMN_DOCS)


def fp8_recipe_settings() -> str:
    """Every registered recipe's settings, read from its signature (lab/core/settings.py checks them from the same
    declaration), and the settings every recipe takes."""
    import inspect

    from lab.core.settings import declared_settings, describe, doc
    from lab.fp8 import RECIPES, _load_recipe_files, common_settings
    _load_recipe_files()

    def rows(label, fn):
        defaults = {n: p.default for n, p in inspect.signature(fn).parameters.items()}
        return [f"| {label} | `{key}` | {describe(kind)} | `{defaults[key]!r}` | {doc(kind)} |"
                for key, kind in declared_settings(fn)[0].items()] or [f"| {label} | (none) | | | |"]
    lines = ["| recipe | setting | accepts | default | what it does |", "|---|---|---|---|---|"]
    for name in sorted(RECIPES):
        lines += rows(f"`{name}`", RECIPES[name])
    return "\n".join(lines + rows("every recipe", common_settings))


def rl_corrections() -> str:
    """Every registered correction of GRPO's sampler/learner mismatch (lab/rl/corrections): its names, settings (read
    from its signature, as create_correction checks them), weight and TRL's / verl's equivalent."""
    import inspect

    from lab.core.settings import declared_settings, describe, doc
    from lab.rl.corrections import CORRECTIONS, available_corrections
    available_corrections()
    lines = ["| correction | settings (default) | weight of token t | TRL / verl equivalent |", "|---|---|---|---|"]
    for cls in sorted(set(CORRECTIONS.values()), key=lambda c: c.name):
        names = ", ".join(f"`{n}`" for n in sorted(CORRECTIONS) if CORRECTIONS[n] is cls)
        defaults = {n: p.default for n, p in inspect.signature(cls).parameters.items()}
        settings = "; ".join(f"`{k}` {describe(kind)} (`{defaults[k]!r}`): {doc(kind)}"
                             for k, kind in declared_settings(cls)[0].items()) or "(none)"
        lines.append(f"| {names} | {settings} | {cls.formula} | {cls.equivalent} |")
    return "\n".join(lines)


def diagnose_codes() -> str:
    """Every finding and recommendation code lab diagnose gives, read from its rules (lab/diagnose/schema.py)."""
    from lab.diagnose.schema import codes
    found, advised = codes()
    lines = ["| code | kind | given by (lab/diagnose/) |", "|---|---|---|"]
    lines += [f"| `{c}` | finding | {', '.join(m)} |" for c, m in found.items()]
    lines += [f"| `{c}` | recommendation | {', '.join(m)} |" for c, m in advised.items()]
    return "\n".join(lines)


SECTIONS = {"fp8-census-columns": fp8_census_columns, "fp8-amax-columns": fp8_amax_columns,
            "fp8-recipe-settings": fp8_recipe_settings, "diagnose-codes": diagnose_codes,
            "rl-corrections": rl_corrections}
_SECTION = re.compile(r"(<!-- generated:([a-z0-9-]+) -->\n)(.*?)(<!-- generated:end -->)", re.S)


def render(text: str) -> str:
    """`text` with every generated section regenerated (an unknown section name: KeyError naming it)."""
    def one(m):
        if m.group(2) not in SECTIONS:
            raise KeyError(f"no generator for section {m.group(2)!r} (lab/report/reference_docs.py SECTIONS)")
        return m.group(1) + SECTIONS[m.group(2)]() + "\n" + m.group(4)
    return _SECTION.sub(one, text)


def stale(docs: Path = DOCS) -> list[Path]:
    """The docs whose generated sections differ from what the code declares."""
    return [p for p in sorted(docs.glob("*.md")) if render(p.read_text()) != p.read_text()]


def write(docs: Path = DOCS) -> list[Path]:
    """Regenerate every doc's sections; the files changed."""
    changed = stale(docs)
    for p in changed:
        p.write_text(render(p.read_text()))
    return changed

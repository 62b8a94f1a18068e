"""`python -m lab docs-tables`: the docs' reference tables regenerated from the code that declares them
(lab/report/reference_docs.py): fp8_census.csv's and fp8_amax.csv's columns, the recipes' settings."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    d = sub.add_parser("docs-tables", help="regenerate the docs' reference tables from the code (census columns, "
                       "recipe settings)")
    d.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale docs")
    d.set_defaults(handler=main)


def main(args) -> int:
    from lab.report import reference_docs
    if args.check:
        stale = reference_docs.stale()
        for p in stale:
            print(f"stale: {p} (python -m lab docs-tables)", file=sys.stderr)
        return 1 if stale else 0
    for p in reference_docs.write():
        print(p)
    return 0

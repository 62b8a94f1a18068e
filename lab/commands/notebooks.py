"""`python -m lab notebooks`: the notebooks executed against a results folder, each written with its outputs
(.ipynb) and as HTML (lab/report/notebooks.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from lab.commands import refuse


def add_parser(sub) -> None:
    n = sub.add_parser("notebooks", help="execute the notebooks against a results folder and write each one with "
                                         "its outputs (.ipynb) and as HTML")
    n.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                   help="notebooks to execute (default: every notebooks/*.ipynb of this repository)")
    n.add_argument("--results", default="results", help="the results folder they read ($LAB_RESULTS); "
                   "default: results")
    n.add_argument("--out", default=None, help="folder to write NAME.ipynb and NAME.html to; default: "
                   "RESULTS/notebooks")
    n.add_argument("--timeout", type=int, default=None, metavar="S",
                   help="seconds one cell may run (default: lab.report.notebooks.CELL_TIMEOUT_S, 600)")
    n.set_defaults(handler=main)


def main(args) -> int:
    """Every notebook executed and rendered, or exit status 1 naming each notebook and cell that raised."""
    from lab.report import notebooks
    paths = args.notebooks or notebooks.notebook_paths()
    out = args.out or str(Path(args.results) / "notebooks")
    try:
        written = notebooks.execute(paths, args.results, out, args.timeout or notebooks.CELL_TIMEOUT_S)
    except ValueError as e:
        return refuse(e)
    except notebooks.NotebookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0

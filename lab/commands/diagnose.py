"""`python -m lab diagnose RUN_DIR`: a run explained (lab/diagnose/): overflow, skips, scale collapse or runaway,
underflow."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    g = sub.add_parser("diagnose", help="explain a run: overflow, skips, scale collapse/runaway, underflow")
    g.add_argument("run_dir", help="run directory (holding metrics.json and steps.csv)")
    g.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")
    g.set_defaults(handler=main)


def main(args) -> int:
    from lab.diagnose import DiagnoseError, diagnose, format_json, format_text
    try:
        d = diagnose(args.run_dir)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_json(d) if args.json else format_text(d))
    return 0

"""`python -m lab diagnose RUN_DIR`: a run explained (lab/diagnose/): overflow, skips, scale collapse or runaway,
underflow."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    g = sub.add_parser("diagnose", help="explain a run: overflow, skips, scale collapse/runaway, underflow")
    g.add_argument("run_dir", nargs="?", help="run directory (holding metrics.json and steps.csv)")
    g.add_argument("--json", action="store_true", help="print the findings as JSON instead of text (its schema: "
                   "--schema, docs/diagnose.schema.json)")
    g.add_argument("--schema", action="store_true", help="print the JSON Schema of --json's output and exit")
    g.set_defaults(handler=main)


def main(args) -> int:
    from lab.diagnose import DiagnoseError, diagnose, format_json, format_text
    if args.schema:
        import json

        from lab.diagnose.schema import json_schema
        sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
        return 0
    if args.run_dir is None:
        print("error: name a run directory (or --schema)", file=sys.stderr)
        return 2
    try:
        d = diagnose(args.run_dir)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_json(d) if args.json else format_text(d))
    return 0

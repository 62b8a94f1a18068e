"""`python -m lab inspect RUN_DIR`: where a run stands (a lab run or a recording), from its files so far
(lab/diagnose/inspect.py)."""
from __future__ import annotations

from lab.commands import refuse


def add_parser(sub) -> None:
    ins = sub.add_parser("inspect", help="where a run stands (a lab run or a recording), from its files so far")
    ins.add_argument("run_dir")
    ins.add_argument("--follow", action="store_true", help="print a line as new steps arrive, until it finishes")
    ins.add_argument("--interval", type=float, default=2.0, help="seconds between looks with --follow (default 2)")
    ins.add_argument("--json", action="store_true", help="print the state as JSON")
    ins.set_defaults(handler=main)


def main(args) -> int:
    import json
    from lab.diagnose.inspect import InspectError, follow, format_inspect, inspect_run
    try:
        if args.follow:
            follow(args.run_dir, args.interval)
            return 0
        state = inspect_run(args.run_dir)
    except InspectError as e:
        return refuse(e)
    print(json.dumps(state, indent=2) if args.json else format_inspect(state))
    return 0

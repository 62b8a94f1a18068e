"""`python -m lab first-steps`: a vision-language run's first steps measured again with hooks
(lab/report/first_steps.py)."""
from __future__ import annotations

from lab.commands import refuse
from lab.core.config import ConfigError, load_study


def add_parser(sub) -> None:
    fs = sub.add_parser("first-steps", help="a vision-language run's first steps measured again with hooks: the "
                        "encoder's feature spread and each branch's gradient range (lab/report/first_steps.py)")
    fs.add_argument("--config", action="append", required=True, metavar="FILE")
    fs.add_argument("--model", required=True)
    fs.add_argument("--modes", nargs="+", required=True)
    fs.add_argument("--seed", type=int, default=0)
    fs.add_argument("--steps", type=int, default=300)
    fs.add_argument("--csv", required=True)
    fs.add_argument("--png", required=True)
    fs.add_argument("--threads", type=int, default=1, help="torch threads: the study's, for the same trajectory")
    fs.set_defaults(handler=main)


def main(args) -> int:
    from lab.report.first_steps import FirstStepsError, write
    if args.steps < 1:
        raise ConfigError(f"--steps: expected at least 1; found {args.steps}")
    try:
        write(load_study(args.config), args.model, args.modes, args.seed, args.steps, args.threads, args.csv, args.png)
    except FirstStepsError as e:
        return refuse(e)
    return 0

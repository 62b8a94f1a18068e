"""`python -m lab tensorboard`: runs' steps.csv and metrics.json as TensorBoard event files
(lab/report/tensorboard.py)."""
from __future__ import annotations

from lab.commands import print_written


def add_parser(sub) -> None:
    b = sub.add_parser("tensorboard", help="convert runs' steps.csv + metrics.json into TensorBoard event files")
    b.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    b.add_argument("--out", default="results/tensorboard", help="event folder root; default: results/tensorboard")
    b.set_defaults(handler=main)


def main(args) -> int:
    from lab.report.tensorboard import export
    return print_written(export(args.runs, args.out), args.runs)

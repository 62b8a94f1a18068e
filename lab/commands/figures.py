"""`python -m lab figures`: the study's figures (PNG, per model) from a results folder (lab/report/figures.py)."""
from __future__ import annotations

from lab.commands import print_written


def add_parser(sub) -> None:
    f = sub.add_parser("figures", help="write the study's figures (PNG, per model) from a results folder")
    f.add_argument("--results", default="results", help="results folder (holding runs/); default: results")
    f.add_argument("--runs", nargs="+", default=None, metavar="RUN_DIR",
                   help="use exactly these run directories instead of every run under --results")
    f.add_argument("--model", action="append", default=None, help="only this model (repeatable)")
    f.add_argument("--out", default="results/figures", help="figures folder; default: results/figures")
    f.add_argument("--study-modes", nargs="*", default=(), metavar="MODE",
                   help="the study's modes: one a model has no runs of gets a figure saying so")
    f.set_defaults(handler=main)


def main(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    from lab.report.figures import write_all
    written = write_all(args.runs or args.results, args.out, models=args.model, study_modes=args.study_modes)
    return print_written(written, args.runs or args.results)

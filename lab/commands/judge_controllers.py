"""`python -m lab judge-controllers`: every scale rule replayed on runs it did not learn from, FP16 policies and FP8
predictors, as tables and Pareto figures (lab/scaling/learning/tables.py; docs/controllers.md)."""
from __future__ import annotations


def add_parser(sub) -> None:
    j = sub.add_parser("judge-controllers", help="every scale rule replayed on held-out runs: FP16 policies "
                       "(skipped steps, flushed shares) and FP8 predictors (clipped steps, unused binades)")
    j.add_argument("--fp16", nargs="*", default=[], metavar="RUN", help="held-out runs with steps.csv/grad_hist.csv")
    j.add_argument("--fp8", nargs="*", default=[], metavar="RUN", help="held-out runs with fp8_amax.csv")
    j.add_argument("--models", required=True, help="the folder of fitted artefacts (learned-fp16-without-<family>"
                   ".json, rl-fp16-without-<family>.json, learned-fp8.json)")
    j.add_argument("--out", required=True, help="folder for the tables (controllers_fp16.csv/.md, _fp8)")
    j.add_argument("--figures", default=None, help="folder for the Pareto figures (default: none)")
    j.set_defaults(handler=main)


def main(args) -> int:
    from lab.scaling.learning import tables
    return tables.main(args)

"""`python -m lab alert-thresholds`: the source's alert thresholds (3 and 10 consecutive skips, a 95% update ratio)
judged as detectors of runs that end worse than FP32, over recorded runs (lab/diagnose/alerts.py, alert_tables.py;
docs/alerts.md); `python -m lab record-catalogue`: the diagnose catalogue's loops recorded as planted failures."""
from __future__ import annotations


def add_parser(sub) -> None:
    a = sub.add_parser("alert-thresholds", help="the source's alert thresholds as detectors: precision and recall "
                       "against runs that end worse than FP32, over recorded runs")
    a.add_argument("runs", nargs="+", metavar="RUNS_GLOB", help="run directories (folders with metrics.json and "
                   "steps.csv: results/controllers/runs/*/*/seed*) or a study's per-run tables (runs.csv), as glob "
                   "patterns (quote them); each must match something")
    a.add_argument("--out", required=True, help="folder for runs.csv, detectors.csv, studies.csv, choice.csv and "
                   "alerts.md")
    a.add_argument("--configs", nargs="+", default=["configs/*.yaml"], metavar="GLOB",
                   help="the study configs whose results_dir holds the runs (their margins and modes); default: "
                        "configs/*.yaml")
    a.set_defaults(handler=main)
    c = sub.add_parser("record-catalogue", help="record the diagnose catalogue's FP16 loops (lab/diagnose/"
                       "catalogue.py) as planted failures, one folder each (kept when already recorded)")
    c.add_argument("--out", required=True, help="folder for the recordings")
    c.set_defaults(handler=record)


def main(args) -> int:
    from lab.diagnose import alert_tables, alerts
    runs = alerts.collect(args.runs, args.configs)
    for path in alert_tables.write(runs, args.out):
        print(path)
    return 0


def record(args) -> int:
    from lab.diagnose.catalogue import record_catalogue
    for path in record_catalogue(args.out):
        print(path)
    return 0

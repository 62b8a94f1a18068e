"""`python -m lab summary-html`: the summary table (summary.csv) as a standalone HTML page
(lab/report/summary_html.py)."""
from __future__ import annotations

from pathlib import Path



def add_parser(sub) -> None:
    h = sub.add_parser("summary-html", help="render the summary table (summary.csv) as a standalone HTML page")
    h.add_argument("csv", help="results/tables/summary.csv")
    h.add_argument("--out", required=True, help="HTML file to write")
    h.set_defaults(handler=main)


def main(args) -> int:
    from lab.core import files, runfiles
    from lab.report.summary_html import summary_html
    files.atomic_write_text(args.out, summary_html(runfiles.read_csv_frame(args.csv)))
    print(Path(args.out))
    return 0

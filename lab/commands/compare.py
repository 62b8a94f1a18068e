"""`python -m lab compare`: two modes side by side, paired by seed (lab/study/compare.py)."""
from __future__ import annotations

import sys

from lab.commands import refuse
from lab.core.config import ConfigError


def add_parser(sub) -> None:
    cp = sub.add_parser("compare", help="two modes side by side, paired by seed: skipped and overflow steps, "
                                        "flushed shares, validation loss (left - right, with intervals)")
    cp.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    cp.add_argument("--left", required=True, help="mode, e.g. fp16-amax")
    cp.add_argument("--right", required=True, help="mode, e.g. fp16-dynamic")
    cp.add_argument("--md", default=None, help="Markdown table to write")
    cp.add_argument("--csv", default=None, help="CSV to write")
    cp.add_argument("--confidence", type=float, default=0.95)
    cp.add_argument("--readme", default=None, help="also replace this Markdown file's section (make claims: "
                    "docs/policies.md) between <!-- compare:start --> and <!-- compare:end --> with the table")
    cp.set_defaults(handler=main)


def main(args) -> int:
    from lab.core import files
    from lab.report.load import load_metrics
    from lab.study.compare import COMPARE_MARKERS, compare_modes, comparison_markdown
    runs = load_metrics(args.runs)
    missing = [m for m in (args.left, args.right) if runs.empty or m not in set(runs["mode"])]
    if missing:
        raise ConfigError(f"--left/--right: no finished runs of mode {', '.join(map(repr, missing))} under "
                          f"{' '.join(args.runs)}")
    from lab.study.verdicts import read_outcomes
    runs = runs.reset_index(drop=True)
    table = compare_modes(runs, args.left, args.right, args.confidence, read_outcomes(runs["run_dir"]))
    markdown = comparison_markdown(table)
    if args.md:
        files.atomic_write_text(args.md, markdown)
    if args.csv:
        files.atomic_write_text(args.csv, table.to_csv(index=False))
    if args.readme:
        from lab.study.claims import ClaimsError, write_readme_section
        try:
            write_readme_section(args.readme, markdown, COMPARE_MARKERS)
        except ClaimsError as e:
            return refuse(e)
    sys.stdout.write(markdown)
    return 0

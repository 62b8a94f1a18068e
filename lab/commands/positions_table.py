"""`python -m lab positions-table`: the long-context study's gradients by position (configs/long-context.yaml): every
run's positions.csv (train.position_probe) by context and mode, its table and figure (lab/report/positions_table.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("positions-table", help="gradients by sequence position, FP16 and FP32 against FP64, by context "
                                               "and mode (runs trained with train.position_probe)")
    p.add_argument("runs", nargs="+", help="run directories, or folders searched for them")
    p.add_argument("--csv", required=True, help="per-position table (positions binned over each sequence)")
    p.add_argument("--md", required=True, help="markdown table: tail and head per (context, mode)")
    p.add_argument("--figure", default=None, help="also draw the figure (PNG) there")
    p.set_defaults(handler=main)


def main(args) -> int:
    from lab.report.positions_table import write
    bins, table = write(args.runs, args.csv, args.md, args.figure)
    print(f"{len(table)} (model, mode) rows, {len(bins)} binned rows -> {args.md}, {args.csv}")
    return 0

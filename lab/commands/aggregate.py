"""`python -m lab aggregate`: run directories summarised into tables (lab/study/aggregate.py)."""
from __future__ import annotations

from lab.core.config import ConfigError


def add_parser(sub) -> None:
    a = sub.add_parser("aggregate", help="summarise run directories into tables")
    a.add_argument("runs", nargs="+", help="run directories (each holding metrics.json)")
    a.add_argument("--csv", required=True)
    a.add_argument("--md", required=True)
    a.add_argument("--confidence", type=float, default=None,
                   help="level of the intervals; the table's false discovery rate and TOST's alpha are 1 - "
                        "confidence (default 0.95)")
    a.add_argument("--margin", action="append", default=[], metavar="METRIC=VALUE",
                   help="equivalence margin for families the claims file does not declare, repeatable: top1=0.01 "
                        "(fraction) and/or val_loss=0.05 (nats)")
    a.add_argument("--declared", default=None, metavar="CLAIMS_YAML",
                   help="the claims file whose `declared:` block gives each family's margins and effects of "
                        "interest (configs/claims.yaml)")
    a.add_argument("--runs-csv", default=None, metavar="CSV",
                   help="also write the per-run table here (one row per run: model, mode, seed, val_loss and the "
                        "other numbers of its metrics.json; what a claims file's per-run claims read)")
    a.set_defaults(handler=main)


def main(args) -> int:
    from lab.study.aggregate import aggregate
    from lab.study.claims.file import load_declared, load_trajectory
    declared = load_declared(args.declared) if args.declared else None
    aggregate(args.runs, args.csv, args.md, _stats_args(args), declared,
              load_trajectory(args.declared) if args.declared else None, args.runs_csv)
    return 0


def _stats_args(args) -> dict:
    """The study's `stats:` block from --confidence / --margin (what workflow/rules/aggregate.smk passes)."""
    from lab.study.aggregate import STAT_METRICS
    cfg: dict = {"margins": {}}
    if args.confidence is not None:
        if not 0.5 < args.confidence < 1:
            raise ConfigError(f"--confidence {args.confidence}: must lie between 0.5 and 1")
        cfg["confidence"] = args.confidence
    for item in args.margin:
        name, _, value = item.partition("=")
        if name not in STAT_METRICS:
            raise ConfigError(f"--margin {item}: unknown metric {name!r}; allowed: {', '.join(STAT_METRICS)}")
        try:
            cfg["margins"][name] = float(value)
        except ValueError:
            raise ConfigError(f"--margin {item}: {value!r} is not a number") from None
        if not cfg["margins"][name] > 0:
            raise ConfigError(f"--margin {item}: the margin must be positive")
    return cfg

"""`python -m lab claims`: a study's claims file decided against its summary (and per-run) tables by the claims
engine (lab/study/claims/)."""
from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    c = sub.add_parser("claims", help="check the source study's claims (configs/claims.yaml) against summary.csv")
    c.add_argument("--summary", default="results/tables/summary.csv", help="default: results/tables/summary.csv")
    c.add_argument("--claims", default="configs/claims.yaml", help="default: configs/claims.yaml")
    c.add_argument("--md", default="results/tables/claims.md", help="markdown table to write; "
                   "default: results/tables/claims.md")
    c.add_argument("--readme", default=None, help="also replace the README's section between "
                   "<!-- claims:start --> and <!-- claims:end --> with the source's claims across every study "
                   "(lab/report/source_claims.py): this file's as decided, the others' from their claims.md")
    c.add_argument("--json", action="store_true", help="print the records as JSON instead of text")
    c.add_argument("--runs", default=None, metavar="CSV", help="a per-run table (one row per run: model, mode, seed "
                   "and its measurements; `lab aggregate --runs-csv` writes one) for claims that read it: a file's "
                   "(reads: runs, as configs/claims_fp8.yaml) or a claim's (configs/claims.yaml); default: the "
                   "runs.csv beside --summary, when there is one")
    c.add_argument("--max-seeds", type=int, default=None, metavar="N",
                   help="a claim that would need more seeds (paired, or per row) than N is out of reach "
                        "(default: lab.study.claims.REACH, 20)")
    c.add_argument("--power", type=float, default=None, metavar="P",
                   help="the power at which the seeds needed are sized (default: lab.study.claims.REACH, 0.8)")
    c.add_argument("--horizon-intervals", type=float, default=None, metavar="K",
                   help="overflow claims need runs of at least K growth intervals of the policy "
                        "(default: lab.study.claims.REACH, 3)")
    c.set_defaults(handler=main)


def main(args) -> int:
    """Evaluate every claim, print it, write the markdown (and the README section); 2 on bad input.

    A file that reads the per-run table (reads: runs) is decided on it alone; a summary file's claims that read it
    (a claim's `reads: runs`) get it too: --runs, else the runs.csv beside the summary when there is one.
    Contradicted claims are findings, not failures: the exit status is 0 whatever the verdicts.
    """
    import json
    from lab.core import files
    from lab.core.runfiles import read_csv_frame
    from lab.study import claims
    try:
        if args.runs is None and (Path(args.summary).parent / "runs.csv").is_file():
            args.runs = str(Path(args.summary).parent / "runs.csv")
        if args.runs and _reads_runs(args.claims):
            return _claims_on_runs(args)
        reach = {"max_seeds": args.max_seeds, "power": args.power, "horizon_intervals": args.horizon_intervals}
        reach = {k: v for k, v in reach.items() if v is not None}
        declared, summary = claims.load_claims(args.claims), claims.load_summary(args.summary)
        tables = {"summary": summary}
        if args.runs and Path(args.runs).is_file():
            tables["runs"] = read_csv_frame(Path(args.runs), ("model", "mode", "seed"))
        plans = claims.load_sequential(args.claims)
        records = claims.evaluate(declared, tables, reach, plans)
        plan = claims.sequential_alpha(plans, summary, 0.05)[1]   # the plan in words (the records hold its level)
        on_runs = any(c.get("reads") == "runs" for c in declared)
        markdown = claims.to_markdown(records, reach, plan, runs=on_runs)
        if args.readme:
            from lab.study.aggregate import FINDINGS_MARKERS, findings_markdown
            why = claims.table_disagreements(declared, records, summary)
            # the README's one table of the source's claims, every study that decides some (lab/report/source_claims.py):
            # this file's verdicts as just decided, the other studies' from their committed claims.md
            from lab.report.source_claims import readme_table
            extra = ("Table and claims: " + " ".join(why)) if why else ""
            claims.write_readme_section(args.readme, readme_table(Path("."), {args.claims: markdown}, extra))
            if FINDINGS_MARKERS[0] in Path(args.readme).read_text():  # the compact findings table, if it has one
                claims.write_readme_section(args.readme, findings_markdown(summary), FINDINGS_MARKERS)
    except claims.ClaimsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files.atomic_write_text(args.md, markdown)
    sys.stdout.write(json.dumps(records, indent=2) + "\n" if args.json else claims.to_text(records))
    return 0


def _reads_runs(path) -> bool:
    """The claims file says `reads: runs` at its top (configs/claims_fp8.yaml): its claims read the per-run table."""
    import yaml
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and raw.get("reads") == "runs"


def _claims_on_runs(args) -> int:
    """A claims file that reads the per-run table (reads: runs), decided by the same engine; 2 on bad input."""
    import json
    from lab.core import files
    from lab.core.runfiles import read_csv_frame
    from lab.study import claims
    try:
        cfg = claims.load_file(args.claims, reads="runs")
        tables = {"runs": read_csv_frame(Path(args.runs), ("model", "mode", "seed"))}
        if Path(args.summary).is_file():
            tables["summary"] = claims.load_summary(args.summary)
        reach = {k: v for k, v in {"max_seeds": args.max_seeds, "power": args.power}.items() if v is not None}
        records = claims.evaluate(cfg, tables, reach or None)
    except claims.ClaimsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    alpha = records[0]["alpha"] if records else cfg.get("alpha", 0.05)
    intro = (f"Declared before the runs ({args.claims}), decided on {args.runs}. Every test's p-value is adjusted "
             f"with Holm's method over all {sum(len(r['tests']) for r in records)} tests of the file (family-wise "
             f"error rate {alpha:g}); the unit is the run's seed, paired across modes. Generated by `python -m lab "
             f"claims --runs`.")
    files.atomic_write_text(args.md, claims.markdown_by_test(records, "The claims, decided", intro))
    sys.stdout.write(json.dumps(records, indent=2, default=str) + "\n" if args.json else claims.to_text(records))
    return 0

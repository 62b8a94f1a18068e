"""`python -m lab replay RUN_DIR`: loss-scaling policies (or, on an FP8 run, recipes) replayed over one recorded run;
`python -m lab replay-table`: the study's FP16 policies replayed on every run, and replay checked against the real
runs (lab/diagnose/replay.py, lab/report/replay_table.py, lab/fp8/replay.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from lab.commands import refuse


def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="replay loss-scaling policies over a recorded run: scales, skips, underflow")
    r.add_argument("run_dir", help="run directory (holding steps.csv with grad_amax, config.yaml, grad_hist.csv)")
    r.add_argument("--policy", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="a policy and its parameters, e.g. dynamic:growth_interval=100 (repeatable; "
                        "default: every registered policy at its defaults)")
    r.add_argument("--recipe", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="an FP8 run (fp8_operands.pt): replay this recipe and settings on its tensors, e.g. "
                        "fp8-current:grad_element=e4m3 (repeatable; default: the run's own recipe, marked "
                        "(this run), then every registered recipe at its defaults)")
    r.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    r.add_argument("--trajectory", metavar="CSV", default=None,
                   help="also write every replayed policy's per-step scale, overflow and skip to this CSV")

    rt = sub.add_parser("replay-table", help="replay the study's FP16 policies on every run, and check replay "
                                             "against the real runs (the agreement table)")
    rt.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    rt.add_argument("--csv", required=True, help="replay.csv to write (one row per run and replayed mode)")
    rt.add_argument("--agreement-csv", required=True, help="the agreement table (CSV) to write")
    rt.add_argument("--agreement-md", required=True, help="the agreement table (Markdown) to write")
    r.set_defaults(handler=main)
    rt.set_defaults(handler=main)


def main(args) -> int:
    """`replay RUN_DIR`: a table (or JSON) of the policies replayed on one run; `replay-table`: the study's tables."""
    import json
    from lab.diagnose.replay import REPLAY_COLUMNS, ReplayError, default_policies, parse_policy, read_run, replay
    if args.command == "replay" and (args.recipe or (not args.policy and (Path(args.run_dir) / "fp8_operands.pt")
                                                     .is_file())):
        return _replay_recipes(args)
    try:
        if args.command == "replay-table":
            from lab.report.replay_table import agreement_markdown, write_replay_tables
            agree = write_replay_tables(args.runs, args.csv, args.agreement_csv, args.agreement_md, sys.stderr)
            sys.stdout.write(agreement_markdown(agree))
            return 0
        specs = [parse_policy(p) for p in args.policy] if args.policy else default_policies()
        record = read_run(args.run_dir)
        rows = [replay(record, name, params, trajectory=bool(args.trajectory)) for name, params in specs]
    except ReplayError as e:
        return refuse(e)
    if args.trajectory:
        from lab.core import files
        traj = [{"policy": r["policy"], "params": r["params"], "step": st, "scale": sc, "overflow": int(o),
                 "skipped": int(k)} for r in rows for st, sc, o, k in r.pop("trajectory")]
        files.atomic_write_csv(args.trajectory, traj, ["policy", "params", "step", "scale", "overflow", "skipped"])
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    print(f"{args.run_dir}: {len(record.steps)} steps, backward = step gradient / {record.divisor}, activation "
          f"headroom {record.headroom} binade(s), {len(record.hist)} census steps")
    width = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in REPLAY_COLUMNS[:-1]}
    print("  ".join(c.ljust(width[c]) for c in width))
    for r in rows:
        print("  ".join(_cell(r[c]).ljust(width[c]) for c in width) + (f"  ({r['ended_reason']})"
                                                                         if r["ended_reason"] else ""))
    _replay_predictors(args.run_dir)
    return 0


def _replay_predictors(run_dir) -> None:
    """An FP8 run's recorded amax histories (fp8_amax.csv): every registered predictor as delayed scaling's rule at
    history lengths 16, 128 and 1024, its clipped steps and unused binades per role (lab/scaling/learning/judge.py)."""
    from lab.scaling.learning import artefact, histories
    from lab.scaling.learning.judge import judge
    from lab.scaling.predictors import available_predictors
    hs = histories.read([run_dir], "fp8")
    if not hs:
        return
    print(f"\nFP8 delayed scaling's predictors over this run's amax histories ({len(hs)} tensors, "
          f"{len(hs[0].amax)} steps): clipped steps (%) / unused binades, per role")
    names = [p for p in available_predictors() if p != "learned" or artefact.exists("auto", "learned-fp8")]
    for name in names:
        for n in (16, 128, 1024):
            rows = {r["role"]: r for r in judge(hs, name, n)}
            print(f"  {name:<12} {n:>5}  " + "  ".join(
                f"{role} {rows[role]['clipped_pct']:.3g}% / {rows[role]['unused_binades']:.3g}"
                for role in ("input", "weight", "grad_output") if role in rows))


def _replay_recipes(args) -> int:
    """`replay RUN_DIR` on an FP8 run: every recipe (or each --recipe) quantizing the run's own tensors."""
    import json
    from lab.fp8.replay import Fp8ReplayError, format_table, replay_run
    from lab.core.settings import parse_spec
    specs = None
    if args.recipe:
        specs = [{"name": name, **params} for name, params in (parse_spec(r, "recipe") for r in args.recipe)]
    try:
        rows = replay_run(args.run_dir, specs)
    except Fp8ReplayError as e:
        return refuse(e)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    print(f"{args.run_dir}: every recipe on this run's own tensors (its latest census step); shares in percent of "
          "each tensor kind, err: the mean relative quantization error")
    print(format_table(rows))
    return 0


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)

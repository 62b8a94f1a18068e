"""The RL study's GRPO commands: ``python -m lab rl-base``, ``rl-train``, ``rl-aggregate``, and those that read its
runs: ``rl-shape``, ``rl-claims``, ``rl-figures`` (their arguments and what they run; the DPO family's are
rl_dpo.py beside this file; the code they drive: lab/rl/). Nothing heavy at import: ``lab figures`` and the other
commands build the same parser without torch."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab.core.errors import ConfigError

__all__ = ["add_parser", "main"]


def add_parser(sub) -> None:
    b = sub.add_parser("rl-base", help="pre-train the RL study's base policy (the arithmetic task, FP32)")
    b.add_argument("--out", required=True, help="the .pt file to write")
    b.add_argument("--steps", type=int, default=400)
    b.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("rl-train", help="one GRPO run of the RL study into a run directory")
    t.add_argument("--config", default="configs/rl.yaml", help="the file holding `modes:`")
    t.add_argument("--mode", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--base", required=True, help="the base policy (rl-base's .pt)")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=None, help="default: the config's train.steps")
    t.add_argument("--divisor", type=float, default=None, help="loss / divisor per backward (FP16's magnitudes of an "
                   "accumulated micro-batch), multiplied back after unscale_; default: the config's train.divisor")
    t.add_argument("--lr", type=float, default=None, help="default: the config's train.lr")
    a = sub.add_parser("rl-aggregate", help="the RL study's runs as tables: share solved against fp32, paired by "
                                            "seed; skipped steps; the mismatch")
    a.add_argument("--config", default="configs/rl.yaml")
    a.add_argument("--csv", required=True)
    a.add_argument("--md", required=True)
    a.add_argument("--runs", default=None, help="also write one row per run here (what rl-claims reads)")
    s = sub.add_parser("rl-shape", help="the mismatch's shape on random GPTs: sequence-level |sum d| by length, "
                                        "per-token |d| by position, one row per (format, model seed)")
    s.add_argument("--seeds", type=int, nargs="+", required=True, help="the random models' seeds (the units)")
    s.add_argument("--csv", required=True)
    c = sub.add_parser("rl-claims", help="decide the RL study's declared claims (configs/claims_rl.yaml)")
    c.add_argument("--claims", default="configs/claims_rl.yaml")
    c.add_argument("--runs", required=True, help="rl-aggregate's --runs table")
    c.add_argument("--shape", default=None, help="rl-shape's table")
    c.add_argument("--dpo-runs", default=None, help="rl-dpo-aggregate's --runs table: the DPO family's runs, read "
                                                  "as rows of the runs table (their modes are the DPO modes)")
    c.add_argument("--md", required=True)
    f = sub.add_parser("rl-figures", help="the RL study's figures: reward per mode with its band, the mismatch "
                                          "histograms, the scale trajectories")
    f.add_argument("--config", default="configs/rl.yaml")
    f.add_argument("--out", required=True, help="the folder to write the PNGs into")
    for p in (b, t, a, s, c, f):
        p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    if args.command == "rl-base":
        from lab.rl.grpo_run import pretrain_base, save_base
        rate = save_base(pretrain_base(args.steps, args.seed), Path(args.out), args.steps, args.seed)
        print(f"base: {args.steps} steps, solves {rate:.1%} of 512 held-out problems -> {args.out}", file=sys.stderr)
        return 0
    if args.command == "rl-shape":
        from lab.rl.shape import shape
        shape(args.seeds, Path(args.csv))
        return 0
    if args.command == "rl-claims":
        from lab.rl.claims import decide  # the claims engine (lab/study/claims/) on the RL tables
        for c in decide(args.claims, args.runs, args.shape, args.md, args.dpo_runs):
            print(f"{c['id']}: {c['verdict']}", file=sys.stderr)
        return 0
    from lab.rl.study import load_rl_study
    study = load_rl_study(args.config)
    if args.command == "rl-aggregate":
        from lab.rl.grpo_aggregate import aggregate
        aggregate(study, Path(args.csv), Path(args.md), Path(args.runs) if args.runs else None)
        return 0
    if args.command == "rl-figures":
        from lab.report.rl_figures import rl_figures
        rl_figures(study, Path(args.out))
        return 0
    modes = study["modes"]
    if args.mode not in modes:
        raise ConfigError(f"--mode {args.mode}: not in {args.config} (modes: {', '.join(modes)})")
    from lab.rl.grpo_study import mode_train
    t = mode_train(study, args.mode)
    given = {k: getattr(args, k) for k in ("steps", "divisor", "lr") if getattr(args, k) is not None}
    settings = {**{k: t[k] for k in ("steps", "divisor", "prompts", "group", "lr", "census_every")}, **given}
    from lab.rl.grpo_run import RLRun, train
    from lab.run.record import RecordError
    if not Path(args.base).is_file():
        raise ConfigError(f"--base {args.base}: no such file (make one with python -m lab rl-base --out {args.base})")
    try:
        metrics = train(RLRun(modes[args.mode], seed=args.seed, **settings), Path(args.base), Path(args.out))
    except RecordError as e:  # an --out that holds a finished run
        raise ConfigError(str(e)) from None
    print(f"{args.mode} seed {args.seed}: solved {metrics['solved_start']:.1%} -> {metrics['solved_end']:.1%}, "
          f"{metrics['skipped_steps']} skipped, mean |log pi - log mu| {metrics['mismatch_abs_mean']:.2g}",
          file=sys.stderr)
    return 0

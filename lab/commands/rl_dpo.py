"""The DPO family's commands: ``python -m lab rl-dpo-base``, ``rl-dpo-train``, ``rl-dpo-aggregate`` (their arguments
and what they run; lab/rl/dpo_run.py, docs/rl.md). Nothing heavy at import: the CLI builds its parser without torch."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab.core.errors import ConfigError

__all__ = ["add_parser", "main"]


def add_parser(sub) -> None:
    b = sub.add_parser("rl-dpo-base", help="pre-train the DPO family's base (pydoc's pretrain half, FP32)")
    b.add_argument("--out", required=True, help="the .pt file to write")
    b.add_argument("--steps", type=int, default=300)
    b.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("rl-dpo-train", help="one DPO run of the RL study's DPO family into a run directory")
    t.add_argument("--config", default="configs/rl.yaml", help="the file holding the `dpo:` block")
    t.add_argument("--mode", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--base", required=True, help="the base (rl-dpo-base's .pt)")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=None, help="default: the config's dpo.train.steps")
    a = sub.add_parser("rl-dpo-aggregate", help="the DPO family's runs as tables: held-out preference accuracy "
                                                "against dpo-fp32, paired by seed; non-finite and skipped steps")
    a.add_argument("--config", default="configs/rl.yaml")
    a.add_argument("--csv", required=True)
    a.add_argument("--md", required=True)
    a.add_argument("--runs", default=None, help="also write one row per run here (what rl-claims --dpo-runs reads)")
    for p in (b, t, a):
        p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    if args.command == "rl-dpo-base":
        from lab.rl.dpo_run import pretrain_dpo_base, save_dpo_base
        loss = save_dpo_base(pretrain_dpo_base(args.steps, args.seed), Path(args.out), args.steps, args.seed)
        print(f"DPO base: {args.steps} steps, validation loss {loss:.3f} nats/token -> {args.out}", file=sys.stderr)
        return 0
    from lab.rl.study import load_rl_study
    study = load_rl_study(args.config)
    dpo = study["dpo"]
    if dpo is None:
        raise ConfigError(f"--config {args.config}: no `dpo:` block (the DPO family's settings and modes; docs/rl.md)")
    if args.command == "rl-dpo-aggregate":
        from lab.rl.dpo_aggregate import dpo_aggregate
        dpo_aggregate(study, Path(args.csv), Path(args.md), Path(args.runs) if args.runs else None)
        return 0
    if args.mode not in dpo["modes"]:
        raise ConfigError(f"--mode {args.mode}: not in {args.config}'s dpo.modes ({', '.join(dpo['modes'])})")
    if not Path(args.base).is_file():
        raise ConfigError(f"--base {args.base}: no such file (make one with python -m lab rl-dpo-base --out "
                          f"{args.base})")
    settings = {**dpo["train"], **({"steps": args.steps} if args.steps is not None else {})}
    from lab.rl.dpo_run import DPORun, train_dpo
    from lab.run.record import RecordError
    try:
        m = train_dpo(DPORun(dpo["modes"][args.mode], seed=args.seed, **settings), Path(args.base), Path(args.out))
    except RecordError as e:  # an --out that holds a finished run
        raise ConfigError(str(e)) from None
    print(f"{args.mode} seed {args.seed}: held-out accuracy {m['accuracy_start']:.1%} -> {m['accuracy_end']:.1%}, "
          f"reward margin {m['margin_end']:.3f}, {m['nonfinite_steps']} non-finite, {m['skipped_steps']} skipped",
          file=sys.stderr)
    return 0

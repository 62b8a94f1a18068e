"""`python -m lab fit-controller`: a learned amax predictor or the RL loss-scale controller fitted on recorded runs,
into a versioned artefact (lab/scaling/learning/; docs/controllers.md). Its judge: judge_controllers.py."""
from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    f = sub.add_parser("fit-controller", help="fit a learned amax predictor (quantile regression) or the RL "
                       "loss-scale controller on recorded runs, into a versioned artefact (JSON)")
    f.add_argument("runs", nargs="+", help="run directories to learn from (steps.csv's grad_amax for fp16, "
                   "fp8_amax.csv for fp8; the controller also reads grad_hist.csv)")
    f.add_argument("--out", required=True, help="the artefact to write, e.g. results/controllers/models/mine.json")
    f.add_argument("--controller", choices=("learned", "rl"), default="learned",
                   help="learned: the quantile predictor (default); rl: the FP16 loss-scale controller")
    f.add_argument("--history", choices=("fp16", "fp8"), default="fp16",
                   help="which histories to learn from (rl: fp16 only)")
    f.add_argument("--quantile", type=float, default=0.99, help="learned: the upper quantile predicted (0.99)")
    f.add_argument("--iterations", type=int, default=150, help="rl: REINFORCE iterations (150)")
    f.add_argument("--seed", type=int, default=0, help="rl: the sampling seed (0)")
    f.set_defaults(handler=main)


def main(args) -> int:
    """0 with the artefact written; bad input (no such run, no history to learn from, a quantile outside (0, 1)):
    ConfigError, refused by lab.cli in one line with status 2."""
    from lab.core.errors import ConfigError
    from lab.scaling.learning import artefact
    from lab.scaling.learning.histories import read_for_fit
    missing = [r for r in args.runs if not Path(r).is_dir()]
    if missing:
        raise ConfigError(f"fit-controller: no run directory {', '.join(missing)}")
    if not 0.0 < args.quantile < 1.0 or args.iterations < 1:
        raise ConfigError(f"fit-controller: --quantile must be in (0, 1) and --iterations >= 1, got "
                          f"{args.quantile}, {args.iterations}")
    if args.controller == "learned":
        import numpy as np
        from lab.scaling.learning import histories
        from lab.scaling.learning.features import FEATURES, WINDOW
        from lab.scaling.learning.fit import pinball, quantile_fit, samples
        per_run, runs = read_for_fit(args.runs, lambda run: histories.read([run], args.history))
        hs = [h for run_histories in per_run for h in run_histories]
        x, y = samples([h.amax for h in hs])
        try:
            beta = quantile_fit(x, y, args.quantile)
        except ValueError as e:  # too few samples: the runs hold no (or too short) histories of this kind
            raise ConfigError(f"fit-controller: {len(hs)} {args.history} histories in the runs given: {e}") from None
        data = {"kind": "quantile-linear", "history": args.history, "quantile": args.quantile,
                "features": list(FEATURES), "window": WINDOW, "coef": [round(float(b), 10) for b in beta],
                "samples": int(len(y)), "histories": len(hs),
                "train_pinball": round(pinball(x, y, beta, args.quantile), 8),
                "train_exceeded_pct": round(float(100.0 * np.mean(y > x @ beta)), 4), "runs": runs}
    else:
        if args.history != "fp16":
            print("error: --controller rl learns the FP16 loss scale: --history fp16", file=sys.stderr)
            return 2
        import torch
        from lab.diagnose.replay import ReplayEnv
        from lab.scaling.learning import controller
        records, runs = read_for_fit(args.runs, _replay_record)
        envs = [ReplayEnv(record) for record in records if record is not None]
        if not envs:
            raise ConfigError("fit-controller: no run given holds steps.csv with grad_amax to learn in")
        every = max(1, args.iterations // 10)
        out = controller.train(envs, seed=args.seed, iterations=args.iterations, progress=lambda it, ret: print(
            f"iteration {it + 1}/{args.iterations}: mean return {ret:.3f}", file=sys.stderr)
            if (it + 1) % every == 0 else None)
        weights = torch.tensor(out["coef"], dtype=torch.float64).reshape(out["shape"])
        data = {"kind": "rl-linear", "history": "fp16", "features": list(controller.FEATURES),
                "actions": list(controller.ACTIONS), "init_scale": 1024.0, "seed": args.seed,
                "iterations": args.iterations, "coef": [round(c, 10) for c in out["coef"]],
                "curve": [round(c, 5) for c in out["curve"]], "learned": controller.describe(weights), "runs": runs}
    path = artefact.save(data, args.out)
    print(f"wrote {path}: {data['kind']} from {len(runs)} runs")
    return 0


def _replay_record(run_dir):
    """The run as the replay reads it, None (said) where it cannot (no steps.csv with grad_amax)."""
    from lab.diagnose.replay import ReplayError, read_run
    try:
        return read_run(run_dir)
    except ReplayError as e:
        print(f"skipped: {e}", file=sys.stderr)
        return None

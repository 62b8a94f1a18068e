"""Calibrate the study's verdicts through its own commands (lab/study/calibration_runs.py): null studies shaped
like the study config (its families, modes, seeds and validation units), written as run directories and run through
aggregate, claims and compare. Writes results/benchmarks/calibration_runs.json.

    python benchmarks/calibration/calibrate_study_runs.py [--reps 150] [--config configs/default.yaml]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.core.config import load_study  # noqa: E402
from lab.study import calibration, calibration_runs  # noqa: E402

SCENARIOS = {"fp16-noscale 10x wider": dict(wide=10.0), "fp16-noscale 3x wider": dict(wide=3.0),
             "mode x example interaction": dict(wide=10.0, interaction=calibration.INTERACTION_SD),
             "fp16-noscale 5x wider": dict(wide=5.0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=150)
    p.add_argument("--config", action="append")
    p.add_argument("--claims", default="configs/claims.yaml")
    p.add_argument("--out", default="results/benchmarks/calibration_runs.json")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="only these null scenarios, merged into --out (default: all)")
    p.add_argument("--power-only", action="store_true",
                   help="only the power check (a true effect near the LM's declared one), added to --out")
    args = p.parse_args()
    study = load_study(args.config)
    out = {"reps": args.reps, "command": " ".join(["python", *sys.argv]), "scenarios": {}}
    if args.power_only:
        prior = Path(args.out)
        out = {**(json.loads(prior.read_text()) if prior.is_file() else out), "power_command": out["command"]}
        # a quality shift of 0.21 moves the LM's validation loss by ~0.040 nats, its declared effect (0.041)
        r = calibration_runs.power_rate(args.reps, study, args.claims, "lm", "fp16-static128", 0.21, seed=4)
        lows = [int(str(n).split("–")[0]) for n in r["seeds_needed"] if str(n)[:1].isdigit()]
        out["power"] = {"cell": "lm fp16-static128 val_loss", "reps": r["reps"], "resolved": r["power"],
                        "mean_delta": r["mean_delta"], "seeds_in_hand": len(study["models"]["lm"]["seeds"]),
                        "tables_saying_the_seeds_suffice": sum(n <= 6 for n in lows)}
        print(out["power"])
        files.atomic_write_json(args.out, out)
        return 0
    if args.scenario:  # the others' results kept as they are in --out
        prior = Path(args.out)
        out = {**(json.loads(prior.read_text()) if prior.is_file() else out), "scenarios_command": out["command"]}
        out.setdefault("scenarios", {})
    for i, (name, kw) in enumerate(SCENARIOS.items()):
        if args.scenario and name not in args.scenario:
            continue
        t0 = time.perf_counter()
        rates = calibration_runs.null_rates(args.reps, study, args.claims, seed=100 + i, **kw)
        for k in ("cell_ordinary", "cell_wide", "table_any", "claims_any", "compare_any"):
            n = {"cell_ordinary": rates["n_ordinary"], "cell_wide": rates["n_wide"]}.get(k, rates["reps"])
            rates[f"{k}_se"] = math.sqrt(max(rates[k] * (1 - rates[k]), 1e-12) / max(n, 1))
        rates["seconds"] = round(time.perf_counter() - t0, 1)
        out["scenarios"][name] = rates
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in rates.items()}, flush=True)
    files.atomic_write_json(args.out, {**out, "time": files.now_iso(), "git": files.git_commit()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

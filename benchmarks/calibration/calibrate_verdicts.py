"""Calibrate the study's verdict procedure by simulation (lab/study/calibration.py) with more draws than the
suite's test takes, and write the rates: results/benchmarks/calibration.json.

    python benchmarks/calibration/calibrate_verdicts.py --reps 1000

Under no true difference: the per-cell rate of p ≤ 0.05 (ordinary modes, and the LM's mode with 150x the spread),
the share of studies with any cell resolved after Benjamini–Hochberg (the family-wise rate under the complete
null), and the cells decided although the seed spread is zero (must be 0). With planted effects: the power.
Each rate comes with its Monte Carlo standard error.
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
from lab.study import calibration  # noqa: E402


def _se(rate: float, n: int) -> float:
    return math.sqrt(max(rate * (1 - rate), 1e-12) / n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1000)
    p.add_argument("--out", default="results/benchmarks/calibration.json")
    args = p.parse_args()
    t0 = time.time()
    families = calibration.study_families(None, wide=10.0)  # the shipped config's shape, a wild mode 10x wider
    null = calibration.null_rates(args.reps, families, seed=101)
    tie = calibration.tie_rate(10 * args.reps, seed=102)
    fixed = calibration.fixed_shift_rate(args.reps // 5, seed=103)
    powers = {f"lm val_loss, quality +{e}": calibration.power(args.reps // 5, e, families, seed=104, mode=2)
              for e in (0.01, 0.02)}
    out = {
        "reps": args.reps, "seconds": round(time.time() - t0, 1),
        "null": {**null, "cell_ordinary_se": _se(null["cell_ordinary"], null["n_ordinary"]),
                 "cell_wild_se": _se(null["cell_wild"], null["n_wild"]),
                 "study_any_se": _se(null["study_any"], null["reps"])},
        "ties": tie, "fixed_shift": fixed,
        "power": {k: {"power": pw, "mean_delta": d, "se": _se(pw, args.reps // 5)} for k, (pw, d) in powers.items()},
        "command": f"python benchmarks/calibration/calibrate_verdicts.py --reps {args.reps}",
    }
    files.atomic_write_json(args.out, out)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

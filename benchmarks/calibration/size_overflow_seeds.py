"""Seeds for the growth-horizon study's overflow claims: the power of the exact conditional Poisson test
(lab.study.inference.poisson_compare: given the two rows' summed counts, the left's share is binomial) at Holm's first
step over the claims file's tests, from a measured reference rate and a declared rate ratio.

    python benchmarks/calibration/size_overflow_seeds.py --rate 7/25985 --ratio 3 --tests 8 --steps 6490

The reference rate: MobileNet-v2's 7 in-training overflow steps in 25,985 steps (results/growth_horizon, seeds 0-3,
commit 61e4650), the lowest rate measured at the horizon bar the LM's 0. Equal exposure per family (each run's steps
after its first clean step, ~6490 of 6500)."""
from __future__ import annotations

import argparse
from fractions import Fraction

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.study.inference import poisson_power as power  # noqa: E402 (the claims engine's, one place)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="7/25985", help="the reference rate per step (a fraction)")
    ap.add_argument("--ratio", type=float, default=3.0, help="the declared rate ratio, left / right")
    ap.add_argument("--tests", type=int, default=8, help="tests in the claims file (Holm's first step: 0.05 / tests)")
    ap.add_argument("--steps", type=float, default=6490.0, help="exposure per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6, 7, 8, 10, 12])
    a = ap.parse_args()
    rate, level = float(Fraction(a.rate)), 0.05 / a.tests
    print(f"reference {1000 * rate:.3f} per 1000 steps, level {level:.5f} (one-sided)")
    print("seeds | support at ratio {0:g} | contradict: left never overflows | contradict at ratio 1/{0:g}".format(a.ratio))
    for n in a.seeds:
        e = a.steps * n
        print(f"{n} | {power(a.ratio * rate, rate, e, level):.3f} | {power(1e-12, rate, e, level, False):.3f} | "
              f"{power(rate / a.ratio, rate, e, level, False):.3f}")


if __name__ == "__main__":
    main()

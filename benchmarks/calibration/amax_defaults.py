"""How amax-history's defaults were chosen: the policy replayed (lab/diagnose/replay.py) over every FP32 run of a
study for a grid of (history, margin, init_scale), per family: replayed overflow steps (total over seeds), final
and lowest scale, and the flushed shares (mean over seeds). The chosen defaults are the least margin and a
history with no replayed overflow in any family, plus one binade of margin (docs/replay.md).

    python benchmarks/calibration/amax_defaults.py --results results --out results/benchmarks/amax_defaults.csv
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.diagnose.replay import read_run, replay  # noqa: E402
from lab.report.load import run_dirs, run_identity  # noqa: E402


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--out", default="results/benchmarks/amax_defaults.csv")
    ap.add_argument("--history", type=int, nargs="+", default=[1, 4, 16, 64, 1024])
    ap.add_argument("--margin", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--init-scale", type=float, nargs="+", default=[1.0, 1024.0])
    args = ap.parse_args(argv)
    records = [(run_identity(d), read_run(d)) for d in run_dirs(args.results, mode="fp32", complete=True)]
    rows = []
    for h, m, i in itertools.product(args.history, args.margin, args.init_scale):
        for ident, rec in records:
            out = replay(rec, "amax-history", {"history": h, "margin": m, "init_scale": i})
            rows.append({"model": ident["model"], "seed": ident["seed"], "history": h, "margin": m, "init_scale": i,
                         **{k: out[k] for k in ("overflow_steps", "final_scale", "min_scale", "flushed_activation",
                                                "flushed_param")}})
    df = pd.DataFrame(rows)
    table = df.groupby(["history", "margin", "init_scale", "model"], as_index=False).agg(
        seeds=("seed", "count"), overflow_steps=("overflow_steps", "sum"), final_scale=("final_scale", "median"),
        min_scale=("min_scale", "min"), flushed_activation=("flushed_activation", "mean"),
        flushed_param=("flushed_param", "mean"))
    files.atomic_write_text(Path(args.out), table.to_csv(index=False))
    wide = table.pivot_table(index=["history", "margin", "init_scale"], columns="model", values="overflow_steps")
    print(wide.to_string())
    return table


if __name__ == "__main__":
    main()

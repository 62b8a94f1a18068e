"""Measure the project's two time budgets on this machine and check the accuracy floor.

1. The default study: `snakemake --cores N` from scratch in a temporary copy of the repository
   (environment already built), its wall time, and FP32 validation top-1 per model family (>= 0.90).
2. The test suite: `python -m pytest -q`, its wall time.

    python benchmarks/calibration/bench_budget.py [--cores 2] [--skip-tests] [--out results/benchmarks/budget.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402


def timed(cmd, cwd):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=env)
    return time.perf_counter() - t0, res.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--copy-results", action="store_true",
                   help="after a successful study, copy its tables and figures into this repository's results/")
    p.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "budget.json"))
    args = p.parse_args()
    report = {"cpu": files.cpu_name(), "cpu_info": files.cpu_info(), "logical_cpus": os.cpu_count(),
              "cores": args.cores,
              "versions": files.package_versions(), "git": files.git_commit(), "time": files.now_iso()}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "lab"
        copy.mkdir()
        for name in ("Snakefile", "workflow", "lab", "configs", "profiles", "notebooks"):
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, copy / name)
        wall, rc = timed([str(Path(sys.executable).parent / "snakemake"), "--cores", str(args.cores)], copy)
        table = pd.read_csv(copy / "results" / "tables" / "summary.csv") if rc == 0 else None
        if args.copy_results:  # the runs even after a failed rule (they are what the time bought)
            for sub in ("tables", "figures", "runs") if rc == 0 else ("runs",):
                if (copy / "results" / sub).is_dir():
                    shutil.copytree(copy / "results" / sub, REPO / "results" / sub, dirs_exist_ok=True)
    report["study"] = {"command": f"snakemake --cores {args.cores}", "wall_s": wall, "returncode": rc}
    if table is not None:
        fp32 = table[table["mode"] == "fp32"].set_index("model")["top1_mean"].to_dict()
        report["study"].update(runs=int(table["n_seeds"].sum()), rows=len(table), fp32_top1=fp32,
                               fp32_top1_min=min(fp32.values()), min_seeds=int(table["n_seeds"].min()))
    print(f"study: {wall:.0f} s (rc {rc})", report["study"].get("fp32_top1"), flush=True)
    if not args.skip_tests:
        twall, trc = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], REPO)
        report["tests"] = {"command": "python -m pytest -q", "wall_s": twall, "returncode": trc}
        print(f"tests: {twall:.0f} s (rc {trc})", flush=True)
    files.atomic_write_json(args.out, report)
    print(f"wrote {args.out}")
    ok = rc == 0 and (args.skip_tests or report["tests"]["returncode"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Kill runs of the default study with SIGKILL at random times, resume them, and compare with uninterrupted runs.

Each trial picks a (model, mode) of configs/default.yaml and a kill time at random (seeded), runs
`python -m lab train` once uninterrupted and once killed after that many seconds, then runs the same
command again on the killed run's directory (it resumes from the checkpoint), and compares steps.csv,
census.csv, grad_hist.csv and metrics.json (timing fields aside). Checkpoints every --checkpoint-every steps
(checkpoint settings do not change a run's config hash or results).

    python benchmarks/reliability/bench_kill_resume.py [--trials 10] [--seed 0] [--checkpoint-every 5]
        [--out results/benchmarks/kill_resume.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core.config import load_study  # noqa: E402
from lab.core.study import study_runs
from lab.core.files import atomic_write_json, cpu_info, now_iso  # noqa: E402

TIMING = {"wall_s", "train_time_s", "throughput_samples_per_s", "peak_memory_mb"}


def command(model, mode, out, every) -> list[str]:
    return [sys.executable, "-m", "lab", "train", "--model", model, "--mode", mode, "--seed", "0", "--out",
            str(out), "--set", f"train.checkpoint_every={every}"]


def files(run_dir: Path) -> dict:
    out = {n: (run_dir / n).read_text() for n in ("steps.csv", "census.csv", "grad_hist.csv")}
    out["metrics"] = {k: v for k, v in json.loads((run_dir / "metrics.json").read_text()).items() if k not in TIMING}
    return out


def trial(model, mode, every, fraction, tmp: Path) -> dict:
    ref, run = tmp / "reference", tmp / "killed"
    t0 = time.perf_counter()
    subprocess.run(command(model, mode, ref, every), cwd=REPO, check=True, capture_output=True)
    duration = time.perf_counter() - t0
    delay = fraction * duration
    proc = subprocess.Popen(command(model, mode, run, every), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(delay)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = sorted((run / "checkpoint").glob("step*.pt")) if (run / "checkpoint").is_dir() else []
    resumed_from = int(ckpts[-1].stem[4:]) if ckpts else None
    subprocess.run(command(model, mode, run, every), cwd=REPO, check=True, capture_output=True)
    a, b = files(ref), files(run)
    differing = [k for k in a if a[k] != b[k]]
    return {"model": model, "mode": mode, "kill_after_s": round(delay, 2), "run_s": round(duration, 2),
            "killed": killed, "resumed_from_step": resumed_from, "identical": not differing,
            "differing": differing}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--out", default="results/benchmarks/kill_resume.json")
    args = p.parse_args()
    rng = random.Random(args.seed)
    pairs = sorted({(m, mode) for m, mode, _ in study_runs(load_study([REPO / "configs" / "default.yaml"]))})
    rows = []
    for i in range(args.trials):
        model, mode = rng.choice(pairs)
        with tempfile.TemporaryDirectory() as tmp:
            row = trial(model, mode, args.checkpoint_every, rng.uniform(0.3, 0.95), Path(tmp))
        rows.append(row)
        print(f"trial {i + 1}: {model}/{mode} killed after {row['kill_after_s']} s of {row['run_s']} s "
              f"(resumed from step {row['resumed_from_step']}): "
              f"{'identical' if row['identical'] else 'DIFFERENT: ' + ', '.join(row['differing'])}", flush=True)
    same = sum(r["identical"] for r in rows)
    print(f"{same} of {len(rows)} identical")
    atomic_write_json(args.out, {"benchmark": "kill -9 and resume", "cpu": cpu_info(),
                                       "checkpoint_every": args.checkpoint_every, "seed": args.seed,
                                       "time": now_iso(), "identical": same, "trials": rows})
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

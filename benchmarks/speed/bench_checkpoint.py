"""What checkpointing costs: the same run with checkpoints off, at the default interval, and after every step.

Each model trains one run of the default study's configuration (shortened with --steps) three ways in one
process, interleaved over --rounds: checkpoints off (checkpoint_every 0, checkpoint_minutes 0), the default
(every 10 minutes: none in a short run), and after every optimizer step (the worst case). Reports the
training-time ratio to "off" and the time one checkpoint takes, from which the overhead at the default
interval of a long run follows: one checkpoint per 10 minutes.

    python benchmarks/speed/bench_checkpoint.py [--models resnet50 lm] [--steps 40] [--rounds 3]
        [--out results/benchmarks/checkpoint.json]
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402
from lab.core.config import apply_overrides, load_study, resolve_run  # noqa: E402
from lab.run import checkpoint  # noqa: E402
from lab.run.train import train  # noqa: E402

SETTINGS = {"off": ["train.checkpoint_every=0", "train.checkpoint_minutes=0"],
            "default": [],
            "every step": ["train.checkpoint_every=1", "train.checkpoint_minutes=0"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "lm"])
    p.add_argument("--mode", default="fp16-dynamic")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/benchmarks/checkpoint.json")
    args = p.parse_args()
    study = load_study([REPO / "configs" / "default.yaml"])
    results = []
    saves = []
    original_save = checkpoint.save

    def timed_save(*a, **k):
        t0 = time.perf_counter()
        path = original_save(*a, **k)
        saves.append(time.perf_counter() - t0)
        return path
    checkpoint.save = timed_save
    for model in args.models:
        times = {name: [] for name in SETTINGS}
        saves.clear()
        for _ in range(args.rounds):
            for name, sets in SETTINGS.items():
                cfg = apply_overrides(resolve_run(study, model, args.mode, 0),
                                      [f"train.max_steps={args.steps}", "train.census_every=0"] + sets)
                with tempfile.TemporaryDirectory() as tmp:
                    m = train(cfg, Path(tmp) / "run", progress=io.StringIO())
                times[name].append(m["train_time_s"])
        med = {k: statistics.median(v) for k, v in times.items()}
        per_save = statistics.median(saves) if saves else float("nan")
        row = {"model": model, "steps": args.steps, **{f"{k.replace(' ', '_')}_s": v for k, v in med.items()},
               "default_over_off": med["default"] / med["off"], "every_step_over_off": med["every step"] / med["off"],
               "seconds_per_checkpoint": per_save, "overhead_at_10_min": per_save / 600}
        results.append(row)
        print(f"{model:10s} off {med['off']:.2f} s  default {med['default']:.2f} s ({row['default_over_off']:.3f}x)  "
              f"every step {med['every step']:.2f} s ({row['every_step_over_off']:.3f}x)  one checkpoint "
              f"{1000 * per_save:.1f} ms = {100 * row['overhead_at_10_min']:.4f}% of 10 minutes", flush=True)
    files.atomic_write_json(args.out, {"benchmark": "checkpoint overhead", "cpu": files.cpu_info(),
                                       "versions": files.package_versions(), "time": files.now_iso(),
                                       "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

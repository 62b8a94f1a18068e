"""Cost of overflow attribution (lab.numerics.monitor.NumericsMonitor) in a training step.

Same optimizer step as benchmarks/speed/bench_census.py (lab/run/train.py's: FP16 autocast with the tensor-core
contract on CPU (lab.numerics.contract), static loss scale, AdamW, unscale_, clip_grad_norm_, step, update),
census off (no census step is ever due), in one process. Blocks of ``--steps`` optimizer steps of each variant alternate, their
order rotating every round; times are CPU time of this process (CUDA: synchronised wall time). Reported
per model, as medians over rounds of the ratio to the same steps without a monitor in that round:

* ``replay_overflow_ratio``: every step overflows (scale 2^40; skipped, so the parameters never change and
  every step does the same work) and is replayed for attribution, against the same steps unmonitored: what
  one attributed overflow step costs (about 2: one more forward and backward).
* ``flags_clean_ratio``: clean steps (scale 128) with the per-step parameter-gradient flags that replace the
  replay after ``train.attribution_replays`` replays (``replay_limit=0``), against no monitor.
* ``idle_clean_ratio``: clean steps with the default monitor (replays available: it only keeps the
  random-generator state of each step), against no monitor.

    python benchmarks/speed/bench_attribution.py [--rounds 7] [--steps 5] [--device cpu|cuda]
        [--out results/benchmarks/attribution.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_census import MODELS, Trainer, add_common_args, parse_common  # noqa: E402
from lab import scaling  # noqa: E402
from lab.core import files  # noqa: E402
from lab.numerics.monitor import NumericsMonitor  # noqa: E402

NEVER = 1 << 40  # census_every: no census step comes due in a benchmark


class AttributedTrainer(Trainer):
    def run_block(self, variant: str, steps: int) -> float:
        scale = 2.0 ** 40 if variant.startswith("overflow") else 128.0
        self.scaler = scaling.create("static", scale=scale, device=self.device)
        monitor = None
        if variant in ("overflow_replay", "clean_idle"):
            monitor = NumericsMonitor(self.model, NEVER, attribute=True, replay_limit=1 << 30)
        elif variant == "clean_flags":
            monitor = NumericsMonitor(self.model, NEVER, attribute=True, replay_limit=0)
        total = sum(self.step(monitor, s) for s in range(1, steps + 1))
        if monitor:
            assert monitor.replays == (steps if variant == "overflow_replay" else 0)
            monitor.close()
        return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per block")
    add_common_args(p, "results/benchmarks/attribution.json")
    args = parse_common(p)
    sizes = dict(MODELS)
    pairs = {"replay_overflow_ratio": ("overflow_replay", "overflow_plain"),
             "flags_clean_ratio": ("clean_flags", "clean_plain"),
             "idle_clean_ratio": ("clean_idle", "clean_plain")}
    variants = ["overflow_replay", "overflow_plain", "clean_flags", "clean_plain", "clean_idle"]
    results = []
    for preset in args.models:
        tr = AttributedTrainer(preset, sizes.get(preset, 32), "fp16", args.batch, 128.0, args.device)
        for v in variants:  # warm-up
            tr.run_block(v, 2)
        times = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                times[v].append(tr.run_block(v, args.steps) / args.steps * 1000)
        row = {"model": preset, "image_size": sizes.get(preset, 32), "batch": args.batch, "precision": "fp16",
               "steps_per_block": args.steps, "rounds": args.rounds,
               "step_ms": {v: statistics.median(t) for v, t in times.items()}}
        for name, (a, b) in pairs.items():
            row[name] = statistics.median(x / y for x, y in zip(times[a], times[b]))
        results.append(row)
        print(f"{preset:18s} replayed overflow step x{row['replay_overflow_ratio']:.3f}  "
              f"flags on clean steps x{row['flags_clean_ratio']:.3f}  default monitor on clean steps "
              f"x{row['idle_clean_ratio']:.3f}  (plain clean step {row['step_ms']['clean_plain']:.1f} ms)",
              flush=True)
    report = {"benchmark": "overflow attribution cost per training step (lab.numerics.monitor)",
              "clock": "perf_counter, synchronised" if args.device == "cuda" else "process_time",
              "threads": args.threads, "device": files.device_name(args.device), "cpu": files.cpu_name(),
              "torch": torch.__version__,
              "versions": files.package_versions(), "time": files.now_iso(), "command": sys.argv,
              "results": results}
    files.atomic_write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

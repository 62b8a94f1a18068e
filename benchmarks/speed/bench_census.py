"""Cost of the gradient census (lab.numerics.monitor.NumericsMonitor) in a training step, against census off.

Each model trains as lab/run/train.py does (FP16 autocast with lab.numerics.contract's tensor-core contract on
CPU, a static loss scale, AdamW, clip_grad_norm_, scaler.step/update), and the monitor is called at the same
points.
Blocks of ``every`` optimizer steps alternate in one process: census on (one census interval: a census
step, then every-1 steps on which the monitor's per-step calls run but no hooks exist; overflow
attribution costs only on overflow steps, and this benchmark has none) and census off (no monitor); the
order flips every round. Step times are CPU time of this process (time.process_time), which other jobs on
a shared machine disturb less than wall time; on CUDA (``--device cuda``) wall time with the device
synchronised before each step's clock is read. Reported per model: ``ratio``, the median over rounds of the
on/off time ratio of the two back-to-back blocks (the target is <= 1.10); the per-step medians of each
block kind and their ratio; the median census-step and plain-step times inside the "on" blocks, and
``ratio_estimate`` = 1 + (census step - plain step) / (every * plain step), the same quantity from
step medians within the same blocks (insensitive to drift between blocks).

    python benchmarks/speed/bench_census.py [--every N (default: train.census_every)] [--rounds 7]
        [--precision fp16|fp32|bf16] [--no-replay] [--threads 1] [--device cpu|cuda]
        [--out results/benchmarks/census.json]

An FP16 census step includes its FP32 replay (train.census_fp32_replay, on by default: lab/numerics/monitor.py
census_fp32_replay), as in a lab run; --no-replay measures the census without it.
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import scaling  # noqa: E402
from lab.core import files  # noqa: E402
from lab.core.config import TRAIN_DEFAULTS  # noqa: E402
from lab.data.datasets import load_data  # noqa: E402
from lab.models.presets import create_model  # noqa: E402
from lab.numerics.monitor import NumericsMonitor  # noqa: E402
from lab.run.loop import forward_backward, replay_step  # noqa: E402

MODELS = [("resnet50-digits", 32), ("vit-tiny-digits", 16)]
TARGET_RATIO = 1.10


class Trainer:
    """lab/run/train.py's optimizer step, on a fixed list of digits batches."""

    def __init__(self, preset: str, size: int, precision: str, batch: int, scale: float, device: str = "cpu"):
        torch.manual_seed(0)
        bundle = load_data("digits", None, image_size=size)
        self.device = device
        self.model = create_model(preset, num_classes=bundle.num_classes, in_chans=bundle.in_chans,
                                  input_size=size).to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=3e-3, weight_decay=0.05)
        self.scaler = (scaling.create("static", scale=scale, device=device) if precision == "fp16"
                       else scaling.create("none", enabled=False, device=device))
        self.precision = precision
        xs, ys = zip(*(bundle.train[i] for i in range(8 * batch)))
        self.batches = [(torch.stack(xs[i:i + batch]).to(device), torch.tensor(ys[i:i + batch]).to(device))
                        for i in range(0, 8 * batch, batch)]
        self.i = 0
        self.overflow_steps = 0
        self.fp32_replay = TRAIN_DEFAULTS["census_fp32_replay"]

    def step(self, monitor: NumericsMonitor | None, step: int) -> float:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = self.clock()
        scale = self.scaler.get_scale()
        if monitor:
            monitor.begin_step(step, scale, self.precision)
        forward_backward(self.model, F.cross_entropy, x, y, self.precision, self.device, 1, self.scaler.scale)
        if monitor:
            monitor.after_backward()
            if monitor.wants_fp32_replay():  # as lab/run/loop.py: what FP16 lost, the step again in FP32
                monitor.census_fp32_replay(functools.partial(replay_step, self.model, F.cross_entropy, [(x, y)],
                                                             scale, "fp32", self.device, 1))
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, math.inf)
        self.scaler.step(self.opt)
        self.scaler.update()
        if monitor:
            replay = None  # as lab/run/train.py: a skipped overflow step is replayed for attribution
            if self.scaler.last_found_inf and self.scaler.last_step_skipped:
                replay = functools.partial(replay_step, self.model, F.cross_entropy, [(x, y)], scale,
                                           self.precision, self.device, 1)
            monitor.end_step(self.scaler.last_found_inf, replay)
        self.opt.zero_grad(set_to_none=True)
        self.overflow_steps += bool(self.scaler.last_found_inf)
        return self.clock() - t0

    def clock(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def block(self, every: int, on: bool) -> tuple[float, list[float]]:
        """One census interval: ``every`` steps; with the census on, the first of them is a census step."""
        monitor = NumericsMonitor(self.model, every, attribute=self.scaler.is_enabled(),
                                  fp32_replay=self.fp32_replay) if on else None
        times = [self.step(monitor, s) for s in range(every)]
        if monitor:
            monitor.close()
        return sum(times), times


def add_common_args(p: argparse.ArgumentParser, out: str) -> None:
    """The options of the training-step benchmarks (this one and bench_attribution.py)."""
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", nargs="*", default=[m for m, _ in MODELS])
    p.add_argument("--out", default=out)


def parse_common(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse; refuse --device cuda without CUDA; set the torch thread count."""
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=TRAIN_DEFAULTS["census_every"])
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32", "bf16"])
    p.add_argument("--scale", type=float, default=128.0, help="static loss scale (fp16)")
    p.add_argument("--no-replay", action="store_true",
                   help="FP16: census without the FP32 replay of census steps (train.census_fp32_replay: false)")
    add_common_args(p, "results/benchmarks/census.json")
    args = parse_common(p)
    if args.every < 1:
        p.error("--every must be >= 1")
    sizes = dict(MODELS)
    results = []
    for preset in args.models:
        tr = Trainer(preset, sizes.get(preset, 32), args.precision, args.batch, args.scale, args.device)
        tr.fp32_replay = not args.no_replay
        tr.block(args.every, True)   # warm-up, both ways
        tr.block(args.every, False)
        pair_ratios, on_steps, off_steps, census_ms, plain_ms = [], [], [], [], []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {}
            for on in order:
                got[on] = tr.block(args.every, on)
            pair_ratios.append(got[True][0] / got[False][0])
            on_steps.append(got[True][0] / args.every)
            off_steps.append(got[False][0] / args.every)
            census_ms.append(got[True][1][0] * 1000)
            plain_ms.extend(t * 1000 for t in got[True][1][1:])
        row = {"model": preset, "image_size": sizes.get(preset, 32), "batch": args.batch,
               "precision": args.precision, "every": args.every, "rounds": args.rounds,
               "fp32_replay": tr.fp32_replay and args.precision == "fp16",
               "ratio": statistics.median(pair_ratios), "pair_ratios": pair_ratios,
               "step_ms_census_on": statistics.median(on_steps) * 1000,
               "step_ms_census_off": statistics.median(off_steps) * 1000,
               "ratio_of_medians": statistics.median(on_steps) / statistics.median(off_steps),
               "census_step_ms": statistics.median(census_ms),
               "plain_step_ms": statistics.median(plain_ms) if plain_ms else None,
               "overflow_steps": tr.overflow_steps}
        if plain_ms:
            extra = row["census_step_ms"] - row["plain_step_ms"]
            row["ratio_estimate"] = 1 + extra / (args.every * row["plain_step_ms"])
        row["meets_target"] = row["ratio"] <= TARGET_RATIO
        results.append(row)
        print(f"{preset:18s} {args.precision} every {args.every}: off {row['step_ms_census_off']:7.1f} ms/step  "
              f"on {row['step_ms_census_on']:7.1f} ms/step  ratio {row['ratio']:.3f} "
              f"(of medians {row['ratio_of_medians']:.3f})  census step {row['census_step_ms']:.1f} ms  "
              f"plain step {row['plain_step_ms'] or float('nan'):.1f} ms  "
              f"estimate {row.get('ratio_estimate', float('nan')):.3f}", flush=True)
    report = {"benchmark": "gradient census overhead per training step (census on / off)",
              "target_ratio": TARGET_RATIO, "clock": "perf_counter, synchronised" if args.device == "cuda"
              else "process_time", "threads": args.threads, "device": files.device_name(args.device),
              "cpu": files.cpu_name(),
              "torch": torch.__version__, "versions": files.package_versions(), "time": files.now_iso(),
              "command": sys.argv, "results": results}
    files.atomic_write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

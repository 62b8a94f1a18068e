"""Speed of the fast CPU FP16 backward (lab.fp16_cpu) against PyTorch's native FP16 path and FP32.

Each model's training step (forward + backward, batch 64, the default study's presets) is timed under
three paths in interleaved rounds in one process, so the ratios compare like with like.

    python benchmarks/bench_fp16_cpu.py [--threads 1] [--rounds 3] [--out results/benchmarks/fp16_cpu.json]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import runio  # noqa: E402
from lab.fp16_cpu import fast_cpu_backward  # noqa: E402
from lab.models import create_model  # noqa: E402

MODELS = [("resnet50-digits", 32), ("mobilenetv2-digits", 32), ("vit-tiny-digits", 16)]


def step_fn(model, x, y, path):
    def step():
        if path == "fp32":
            ctx = contextlib.nullcontext()
        else:
            ctx = contextlib.ExitStack()
            ctx.enter_context(torch.autocast("cpu", dtype=torch.float16))
            if path == "fp16-fast":
                ctx.enter_context(fast_cpu_backward())
        with ctx:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/benchmarks/fp16_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for preset, size in MODELS:
        model = create_model(preset, num_classes=10, in_chans=1, image_size=size)
        x, y = torch.randn(64, 1, size, size), torch.randint(0, 10, (64,))
        paths = ["fp32", "fp16-fast", "fp16-native"]
        times = {pth: [] for pth in paths}
        for pth in paths:  # warm-up
            step_fn(model, x, y, pth)()
        for _ in range(args.rounds):
            for pth in paths:
                fn = step_fn(model, x, y, pth)
                t0 = time.perf_counter()
                fn()
                times[pth].append(time.perf_counter() - t0)
        med = {pth: statistics.median(v) * 1000 for pth, v in times.items()}
        row = {"model": preset, "image_size": size, "batch": 64, **{f"{k}_ms": v for k, v in med.items()},
               "speedup_fast_vs_native": med["fp16-native"] / med["fp16-fast"],
               "fast_vs_fp32": med["fp16-fast"] / med["fp32"]}
        results.append(row)
        print(f"{preset:20s} fp32 {med['fp32']:8.1f} ms  fp16-fast {med['fp16-fast']:8.1f} ms  "
              f"fp16-native {med['fp16-native']:9.1f} ms  fast/native speedup {row['speedup_fast_vs_native']:6.1f}x  "
              f"fast/fp32 {row['fast_vs_fp32']:.2f}", flush=True)
    report = {"benchmark": "fp16_cpu training step", "threads": args.threads, "rounds": args.rounds,
              "cpu": runio.cpu_name(), "versions": runio.package_versions(), "time": runio.now_iso(),
              "results": results}
    runio.atomic_write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Speed of CPU FP16/BF16 training under the tensor-core contract (lab.numerics.contract) against FP32 and native
autocast.

Each model's training step (forward + cross-entropy + backward + zero_grad, batch 64, the default study's
presets) is timed under five paths in interleaved rounds in one process, so the ratios compare like with
like: fp32, fp16-contract, bf16-contract (autocast + tensor_core_contract()) in one set of rounds, then
fp16-native and bf16-native (autocast alone: PyTorch's own CPU kernels) in another, each with FP32 timed
beside it. The verdict checks fp16-contract/fp32 <= 1.3 for every family.

    python benchmarks/speed/bench_fp16_cpu.py [--threads 1] [--rounds 5] [--warmup 2] [--skip-native]
                                        [--out results/benchmarks/fp16_cpu.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.models.presets import create_model  # noqa: E402
from lab.numerics.contract import tensor_core_contract  # noqa: E402

MODELS = [("resnet50-digits", 32), ("mobilenetv2-digits", 32), ("vit-tiny-digits", 16)]
BATCH = 64
MAX_FP16_OVER_FP32 = 1.3  # the bar: an FP16 step at most 1.3x the FP32 step
# path -> (autocast dtype or None, whether the contract mode is entered)
PATHS = {"fp32": (None, False),
         "fp16-contract": (torch.float16, True), "bf16-contract": (torch.bfloat16, True),
         "fp16-native": (torch.float16, False), "bf16-native": (torch.bfloat16, False)}


def build(preset, size):
    """A family's model (the default study's preset, random weights) and one batch of BATCH digits-sized images."""
    model = create_model(preset, num_classes=10, in_chans=1, input_size=size)
    return model, torch.randn(BATCH, 1, size, size), torch.randint(0, 10, (BATCH,))


def step(model, x, y, path) -> None:
    dtype, contract = PATHS[path]
    with contextlib.ExitStack() as ctx:
        if dtype is not None:
            ctx.enter_context(torch.autocast("cpu", dtype=dtype))
        if contract:
            ctx.enter_context(tensor_core_contract())
        loss = F.cross_entropy(model(x), y)
    # backward outside autocast, as a training loop does; the contract's autograd Functions carry their own
    loss.backward()
    model.zero_grad(set_to_none=True)


def time_paths(model, x, y, paths, rounds, warmup) -> dict:
    """Median step time (ms) of each path, the paths interleaved round by round."""
    for _ in range(warmup):  # first calls allocate, pick kernels and build autograd caches: not timed
        for pth in paths:
            step(model, x, y, pth)
    times = {pth: [] for pth in paths}
    # interleaved rounds: a slow spell of the machine (another process, frequency change) hits every path
    for _ in range(rounds):
        for pth in paths:
            t0 = time.perf_counter()
            step(model, x, y, pth)
            times[pth].append(time.perf_counter() - t0)
    return {pth: statistics.median(v) * 1000 for pth, v in times.items()}  # median: robust to one outlier


def bench_model(preset, size, native, rounds, warmup) -> dict:
    """The contract paths against FP32, then (apart, each with its own FP32 beside it) the native paths:
    a native FP16 step can take 10x longer and would otherwise sit between the steps being compared."""
    model, x, y = build(preset, size)
    med = time_paths(model, x, y, ["fp32", "fp16-contract", "bf16-contract"], rounds, warmup)
    row = {"model": preset, "image_size": size, "batch": BATCH, **{f"{k}_ms": v for k, v in med.items()}}
    for pth in ("fp16-contract", "bf16-contract"):
        row[f"{pth}_over_fp32"] = med[pth] / med["fp32"]
    if native:
        nat = time_paths(model, x, y, ["fp32", "fp16-native", "bf16-native"], rounds, warmup)
        row["fp32_beside_native_ms"] = nat["fp32"]
        for pth in ("fp16-native", "bf16-native"):
            row[f"{pth}_ms"] = nat[pth]
            row[f"{pth}_over_fp32"] = nat[pth] / nat["fp32"]
        row["fp16_native_over_contract"] = row["fp16-native_over_fp32"] / row["fp16-contract_over_fp32"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-native", action="store_true", help="leave out fp16-native/bf16-native (the slow paths)")
    p.add_argument("--models", nargs="+", default=[m for m, _ in MODELS], choices=[m for m, _ in MODELS])
    p.add_argument("--out", default="results/benchmarks/fp16_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu = files.cpu_info()
    # the native paths' speed depends on these instructions; the contract's should not
    print(f"CPU {cpu['model']} ({cpu['machine']}, {cpu['cores']} cores, torch {cpu['torch_cpu_capability']}): "
          f"FP16 arithmetic {', '.join(cpu['fp16_arithmetic']) or 'none'}, "
          f"BF16 arithmetic {', '.join(cpu['bf16_arithmetic']) or 'none'}; "
          f"threads {args.threads}, rounds {args.rounds}, warmup {args.warmup}", flush=True)
    paths = [pth for pth in PATHS if not (args.skip_native and pth.endswith("-native"))]
    results = []
    for preset, size in [(m, s) for m, s in MODELS if m in args.models]:
        row = bench_model(preset, size, not args.skip_native, args.rounds, args.warmup)
        results.append(row)
        line = f"{preset:20s} fp32 {row['fp32_ms']:7.1f} ms"
        for pth in paths[1:]:
            line += f"  {pth} {row[f'{pth}_ms']:7.1f} ms ({row[f'{pth}_over_fp32']:.2f}x)"
        if "fp16_native_over_contract" in row:
            line += f"  fp16 native/contract {row['fp16_native_over_contract']:.1f}x (ratios to FP32)"
        print(line, flush=True)
    ok = all(r["fp16-contract_over_fp32"] <= MAX_FP16_OVER_FP32 for r in results)
    worst = max(results, key=lambda r: r["fp16-contract_over_fp32"])
    print(f"verdict: fp16-contract/fp32 <= {MAX_FP16_OVER_FP32} for every family: {'PASS' if ok else 'FAIL'} "
          f"(worst {worst['model']} {worst['fp16-contract_over_fp32']:.2f}x)")
    report = {"benchmark": "fp16_cpu training step", "threads": args.threads, "rounds": args.rounds,
              "warmup": args.warmup, "paths": paths, "max_fp16_contract_over_fp32": MAX_FP16_OVER_FP32,
              "pass": ok, "cpu": cpu, "versions": files.package_versions(), "time": files.now_iso(),
              "results": results}
    files.atomic_write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Training-step cost of the lab's ``dynamic`` scaler vs ``torch.amp.GradScaler``.

Both run the same small conv+MLP model (two identical copies, same inputs, SGD with momentum) and
are measured side by side in one process: blocks of steps alternate between the two (the order
flips every repetition). The reported ratio is the median over repetitions of the lab/pytorch
time ratio of the two back-to-back blocks (robust to other load on the machine); the medians of
the per-step times and their ratio are reported too.

* ``train_step``: forward, scaled backward, ``scaler.step``, ``scaler.update`` (the target metric);
* ``scaler_only``: the scaler's share in isolation -- restore fixed gradients, ``scale(loss)``,
  ``step``, ``update`` -- so the engine's Python overhead is visible rather than diluted.

On CUDA the forward runs under ``torch.autocast(float16)``; on CPU everything is FP32.

    python benchmarks/speed/bench_scaler.py --out results/benchmarks/scaler.json
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
import lab.scaling  # noqa: E402

TARGET_RATIO = 1.05


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(32 * 16, 128), nn.ReLU(),
        nn.Linear(128, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


class Runner:
    """One model + optimizer + scaler, with a timed block of steps."""

    def __init__(self, model: nn.Module, scaler, device: torch.device, lr: float = 1e-3):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.scaler = scaler
        self.device = device
        self.amp = device.type == "cuda"
        self.loss_fn = nn.CrossEntropyLoss()
        self.fixed_grads: list[torch.Tensor] | None = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
            loss = self.loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def scaler_only_step(self, loss: torch.Tensor) -> None:
        # Same amount of non-scaler work for both: restore the scaled gradients.
        for p, g in zip(self.model.parameters(), self.fixed_grads):
            p.grad.copy_(g)
        self.scaler.scale(loss)
        self.scaler.step(self.opt)
        self.scaler.update()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_block(self, fn, args, n: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        self.sync()
        return (time.perf_counter() - t0) / n


def measure(runners: dict, fn_name: str, args, reps: int, block: int, warmup: int) -> dict:
    names = list(runners)
    for name in names:  # warm-up (allocator, caches, lazy scale init)
        runners[name].time_block(getattr(runners[name], fn_name), args, max(warmup, 1))
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            r = runners[name]
            times[name].append(r.time_block(getattr(r, fn_name), args, block))
    med = {n: statistics.median(t) for n, t in times.items()}
    # Each repetition times the two back to back, so the per-repetition ratio cancels most of the
    # drift from other load on the machine; its median is the headline number.
    paired = [a / b for a, b in zip(times["lab"], times["pytorch"])]
    return {
        "median_s_per_step": med,
        "ratio_lab_over_pytorch": statistics.median(paired),
        "ratio_of_medians": med["lab"] / med["pytorch"],
        "per_block_s_per_step": times,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/benchmarks/scaler.json")
    ap.add_argument("--reps", type=int, default=80, help="alternating repetitions per measurement")
    ap.add_argument("--block", type=int, default=12, help="steps per timed block")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--skip-scaler-only", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    base = make_model().to(dev)
    # growth_interval large enough that the scale never changes during the run (no overflow on
    # this model either): both scalers do identical numerical work every step.
    kw = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=10**9)
    runners = {
        "lab": Runner(copy.deepcopy(base), lab.scaling.create("dynamic", device=dev.type, **kw), dev),
        "pytorch": Runner(copy.deepcopy(base), torch.amp.GradScaler(dev.type, **kw), dev),
    }
    x = torch.randn(args.batch, 3, args.image, args.image, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    results = {"train_step": measure(runners, "train_step", (x, y), args.reps, args.block, args.warmup)}
    if not args.skip_scaler_only:
        loss = torch.tensor(1.0, device=dev, requires_grad=True)
        for r in runners.values():
            r.train_step(x, y)
            r.fixed_grads = [p.grad.detach().clone() for p in r.model.parameters()]
            r.opt.param_groups[0]["lr"] = 0.0  # keep parameters fixed: identical work every block
        results["scaler_only"] = measure(runners, "scaler_only_step", (loss,), args.reps, args.block * 4,
                                         args.warmup)
    report = _report(args, dev, base, results, runners["lab"].scaler)
    out = Path(args.out)
    files.atomic_write_json(out, report)
    _print(results, report["ratio_lab_over_pytorch"], out)
    return report


def _report(args, dev, base, results: dict, lab_s) -> dict:
    ratio = results["train_step"]["ratio_lab_over_pytorch"]
    return {
        "benchmark": "bench_scaler",
        "description": ("lab.scaling dynamic vs torch.amp.GradScaler, interleaved blocks; ratio = median over "
                        "repetitions of (lab block time / pytorch block time), ratio_of_medians also given"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "config": {"reps": args.reps, "block": args.block, "warmup": args.warmup, "batch": args.batch,
                   "image": args.image, "device": str(dev), "autocast_fp16": dev.type == "cuda",
                   "model_params": sum(p.numel() for p in base.parameters()),
                   "model_tensors": len(list(base.parameters()))},
        "hardware": {"cpu_model": files.cpu_name(), "machine": platform.machine(),
                     "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
        "software": {"torch": torch.__version__, "python": platform.python_version(),
                     "platform": platform.platform()},
        "results": results,
        "ratio_lab_over_pytorch": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "lab_scaler_final": {"scale": lab_s.get_scale(), "steps": lab_s.steps,
                             "skipped_steps": lab_s.skipped_steps},
    }


def _print(results: dict, ratio: float, out: Path) -> None:
    for key, res in results.items():
        med = res["median_s_per_step"]
        print(f"{key:12s} lab {med['lab'] * 1e6:9.1f} us/step   pytorch {med['pytorch'] * 1e6:9.1f} us/step   "
              f"ratio lab/pytorch {res['ratio_lab_over_pytorch']:.4f} (ratio of medians {res['ratio_of_medians']:.4f})")
    print(f"train-step ratio lab/pytorch = {ratio:.4f} (target <= {TARGET_RATIO}) -> "
          f"{'OK' if ratio <= TARGET_RATIO else 'ABOVE TARGET'}; wrote {out}")


if __name__ == "__main__":
    main()

"""Each step's time of one family and mode of configs/fp8.yaml in the lab's own loop, census steps included: where a
recipe's step cost goes between its ordinary steps and its census steps (docs/fp8.md, "Cost").

    python benchmarks/fp8/step_times.py vit mxfp8-rceil [--steps 20] [--config configs/fp8.yaml]

Prints the steps' milliseconds in order after a warm-up pass over the same batches (the first of each census
interval is a census step), their mean, and the mean of the steps that are not census steps."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.core.config import load_study  # noqa: E402
from lab.formats import kernels  # noqa: E402
from lab.run.checkpoint import SignalFlag  # noqa: E402
from lab.run.process import keep_freed_memory  # noqa: E402
from step_cost import _bench_step  # noqa: E402 (its loader of benchmarks/speed/bench_step.py; this folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("mode")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--config", default=str(ROOT / "configs" / "fp8.yaml"))
    a = ap.parse_args()
    # the steady state: the fused quantizer kernels compiled from their first call, as a long run has them (a run
    # compiles a kernel from its COMPILE_AFTER-th call: lab/formats/kernels.py); the warm-up pass compiles them
    kernels.use_compiled(True)
    keep_freed_memory()
    torch.set_num_threads(1)
    bench = _bench_step()
    with SignalFlag() as signals, tempfile.TemporaryDirectory() as tmp:
        cfg, _, loop = bench.lab_loop(load_study([a.config]), a.family, a.mode, 10 * a.steps, Path(tmp) / "run", signals)
        batches = [b for _, b in zip(range(a.steps), loop.train_loader)]
        for x, y in batches:  # warm-up: allocations, kernel choices and compilations, the first census
            loop.feed(x, y, 0)
        times = []
        for x, y in batches:
            t0 = time.perf_counter()
            loop.feed(x, y, 0)
            times.append(1000 * (time.perf_counter() - t0))
    every = cfg.train.census_every or 0
    census = [i for i in range(len(times)) if every and (len(batches) + i) % every == 0]  # after the warm-up pass
    rest = [t for i, t in enumerate(times) if i not in census]
    print(f"{a.family} {a.mode}: " + " ".join(f"{t:.0f}" for t in times))
    print(f"mean {sum(times) / len(times):.1f} ms; census steps {[round(times[i]) for i in census]}; "
          f"the others' mean {sum(rest) / max(len(rest), 1):.1f} ms")


if __name__ == "__main__":
    main()

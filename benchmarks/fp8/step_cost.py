"""The emulated FP8/FP4 training step against the lab's BF16 step, side by side in one process (the bar:
goal 1.5x, at most 2x).

Each family of configs/fp8.yaml and each of its recipe modes runs the lab's own loop (benchmarks/speed/bench_step.py's
`bench_family`: the same initial weights and pre-loaded batches, cycles of one census interval per variant, the
variants interleaved in blocks of a few steps within a cycle, so a slow spell of a shared machine hits them alike);
the ratio is the median over cycles of the per-cycle ratio to BF16's step, the range of those ratios beside it.

    python benchmarks/fp8/step_cost.py [--config configs/fp8.yaml] [--families lm vit] [--rounds 5]
                                       [--out results/fp8/step_cost.json] [--md results/fp8/step_cost.md]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.core import files  # noqa: E402
from lab.core.config import load_study  # noqa: E402
from lab.formats import kernels  # noqa: E402
from lab.core.study import family_modes  # noqa: E402
from lab.run.process import keep_freed_memory, set_true_fp32  # noqa: E402

GOAL, LIMIT = 1.5, 2.0


def _bench_step():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "speed" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ratios(rows: list[dict], reference: str = "bf16") -> list[dict]:
    """Per family and variant: ms per step and the median (range) of its per-cycle ratio to the reference's."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        got = {r["variant"]: r for r in rows if r["family"] == family}
        ref = got[reference]["cycle_ms"]
        for name, r in got.items():
            if name in ("bare", reference):
                continue
            per = [a / b for a, b in zip(r["cycle_ms"], ref)]
            out.append({"family": family, "mode": name, "ms_per_step": r["ms_per_step"],
                        "bf16_ms_per_step": got[reference]["ms_per_step"], "over_bf16": statistics.median(per),
                        "over_bf16_range": [min(per), max(per)]})
    return out


def markdown(rows: list[dict], cpu: dict, threads: int, rounds: int) -> str:
    lines = [f"The emulated step against the lab's BF16 step (`python benchmarks/fp8/step_cost.py`): {cpu['model']} "
             f"({cpu['cores']} cores), {threads} torch thread(s), {rounds} cycles of one census interval per variant, "
             f"interleaved; the ratio: median of the per-cycle ratios (their range). Goal {GOAL}x, limit {LIMIT}x.", "",
             "| family | mode | ms per step | BF16 ms per step | x BF16 [range] | |", "|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["over_bf16_range"]
        mark = "goal" if r["over_bf16"] <= GOAL else "within limit" if r["over_bf16"] <= LIMIT else "**over limit**"
        lines.append(f"| {r['family']} | {r['mode']} | {r['ms_per_step']:.1f} | {r['bf16_ms_per_step']:.1f} | "
                     f"{r['over_bf16']:.2f}x [{lo:.2f}-{hi:.2f}] | {mark} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", default=None)
    p.add_argument("--families", nargs="+")
    p.add_argument("--modes", nargs="+", help="default: each family's modes in the config (fp32 and bf16 always)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/fp8/step_cost.json")
    p.add_argument("--md", default="results/fp8/step_cost.md")
    args = p.parse_args()
    # the steady state: the fused quantizer kernels compiled from their first call, as a long run has them (a run
    # compiles a kernel from its COMPILE_AFTER-th call: lab/formats/kernels.py); the warm-up pass compiles them
    kernels.use_compiled(True)
    torch.set_num_threads(args.threads)
    set_true_fp32("cpu")
    keep_freed_memory()
    study = load_study(args.config or [str(ROOT / "configs" / "fp8.yaml")])
    bench = _bench_step()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families or list(study["models"]):
            modes = args.modes or family_modes(study, family)
            modes = ["fp32", "bf16"] + [m for m in modes if m not in ("fp32", "bf16")]
            rows += bench.bench_family(study, family, modes, args.rounds, Path(tmp))
            print(f"{family}: done", flush=True)
    table = ratios(rows)
    cpu = files.cpu_info()
    md = markdown(table, cpu, args.threads, args.rounds)
    over = [f"{r['family']} {r['mode']} {r['over_bf16']:.2f}x" for r in table if r["over_bf16"] > LIMIT]
    print(md + ("over the limit: " + "; ".join(over) if over else f"every recipe within {LIMIT}x"))
    files.atomic_write_json(args.out, {"benchmark": "emulated recipe step vs BF16", "goal": GOAL, "limit": LIMIT,
                                       "threads": args.threads, "rounds": args.rounds, "cpu": cpu,
                                       "versions": files.package_versions(), "git": files.git_commit(),
                                       "time": files.now_iso(), "over_limit": over, "rows": table})
    files.atomic_write_text(args.md, md)
    return 0 if not over else 1


if __name__ == "__main__":
    sys.exit(main())

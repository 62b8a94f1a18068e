"""What an FP16 gradient reduction costs under FSDP2 sharding, against the FP32 reduction of the same gradients.

With `MixedPrecisionPolicy(reduce_dtype=torch.float16)` the K-way sum of the ranks' gradients is itself FP16, and
FSDP2 divides each rank's gradient by a power of two near sqrt(K) before the sum (to keep the sum in range): values
near FP16's bottom flush to zero there, values near its top overflow in the sum. This script takes the default
study's LM and ViT (configs/default.yaml, their regime: the LM's emulated 32-way accumulation included), trains each
in FP32 for a few steps, and at chosen steps splits the step's batch into K rank shares, computes each rank's FP16
gradient as a sharded rank computes it (the FP16 weights, the CPU's tensor-core contract, the loss times the scale),
and reduces them as FSDP2 does (lab.run.sharding.reduce_like_fsdp: tests/test_fsdp.py checks it bit for bit
against FSDP2's own reduction on two processes). Per (family, step, K, scale): of the values the exact mean holds
non-zero, the share the FP16 reduction flushes and the share the FP32 reduction flushes, and the values FP16 turns
to inf.

    python benchmarks/numerics/fsdp_reduction.py [--steps 0 40] [--world 2 8] [--scales 1 128 65536]
        [--out results/tables/fsdp_reduction.md]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402
from lab.core.config import resolve_run, validate_study  # noqa: E402
from lab.numerics.contract import tensor_core_contract  # noqa: E402
from lab.run.evaluation import flat_cross_entropy  # noqa: E402
from lab.run.optim import build_optimizer  # noqa: E402
from lab.run.process import seed_everything  # noqa: E402
from lab.run.sharding import reduction_census  # noqa: E402


def rank_grads(model, loss_fn, x, y, world: int, scale: float, divisor: int) -> list[list[torch.Tensor]]:
    """Per parameter, each rank's FP16 gradient of its share of the batch (the loss / divisor times the scale)."""
    half = copy.deepcopy(model).half()
    per_rank = []
    for xs, ys in zip(x.chunk(world), y.chunk(world)):
        half.zero_grad(set_to_none=True)
        with tensor_core_contract():  # FP16-stored operands: the contract, as FSDP's FP16 weights get on a GPU
            loss = loss_fn(half(xs if xs.is_floating_point() is False else xs.half()), ys).float()
        (loss / divisor * scale).backward()
        per_rank.append([p.grad.clone() for p in half.parameters()])
    return [list(g) for g in zip(*per_rank)]


def measure(family: str, steps: list[int], worlds: list[int], scales: list[float]) -> list[dict]:
    study = validate_study({**yaml.safe_load((REPO / "configs" / "default.yaml").read_text()), "device": "cpu"})
    cfg = resolve_run(study, family, "fp32", 0)
    seed_everything(0)
    bundle = cfg.data.build()
    model = cfg.model.build(bundle.num_classes, bundle.in_chans, bundle.input_size)
    optimizer = build_optimizer(cfg, [{"params": list(model.parameters())}])
    loss_fn = flat_cross_entropy()
    loader = torch.utils.data.DataLoader(bundle.train, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    divisor = cfg.train.accum_steps * cfg.train.emulated_accum
    rows, batches = [], iter(loader)
    for step in range(max(steps) + 1):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        if step in steps:
            for world in worlds:
                for scale in scales:
                    totals: dict = {}
                    for grads in rank_grads(model, loss_fn, x, y, world, scale, divisor):
                        for k, v in reduction_census(grads).items():
                            totals[k] = max(totals.get(k, 0.0), v) if k == "fp16_max_rel_err" else totals.get(k, 0) + v
                    rows.append({"family": family, "step": step, "world": world, "scale": scale,
                                 "tokens_per_rank_backward": x.numel() // world if bundle.task == "lm" else
                                 x.shape[0] // world, **totals})
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return rows


def markdown(rows: list[dict], machine: str) -> str:
    head = ("| family | step | ranks | scale | values non-zero | FP16 reduction flushed | FP32 reduction flushed | "
            "FP16 overflow |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        nz = r["nonzero"] or 1
        lines.append(f"| {r['family']} | {r['step']} | {r['world']} | {r['scale']:g} | {r['nonzero']} | "
                     f"{r['fp16_flushed']} ({100 * r['fp16_flushed'] / nz:.3f}%) | {r['fp32_flushed']} | "
                     f"{r['fp16_overflow']} |")
    return "\n".join(lines) + (
        "\n\nEach rank's FP16 gradient of its share of the step's batch (the default study's regime), reduced as "
        "FSDP2 reduces it (lab.run.sharding.reduce_like_fsdp: each divided by a power of two near sqrt(K) in FP16, "
        "summed in FP16, the rest of the division after); flushed: values the exact mean of the same FP16 gradients "
        "holds non-zero that the reduction returns as zero. Generated by `python benchmarks/numerics/fsdp_reduction.py` on "
        f"{machine}.\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["lm", "vit"])
    ap.add_argument("--steps", nargs="+", type=int, default=[0, 40])
    ap.add_argument("--world", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--scales", nargs="+", type=float, default=[1.0, 128.0, 65536.0])
    ap.add_argument("--out", default=str(REPO / "results" / "tables" / "fsdp_reduction.md"))
    args = ap.parse_args()
    rows = [r for f in args.families for r in measure(f, args.steps, args.world, args.scales)]
    out = Path(args.out)
    files.atomic_write_text(out, markdown(rows, files.device_name("cpu")))
    files.atomic_write_json(out.with_suffix(".json"), rows)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

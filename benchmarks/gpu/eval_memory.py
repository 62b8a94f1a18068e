"""The LM's evaluation peak memory on a device against what lab/run/sizing.py predicted.

GPT-2 small's shape (or --tiny: the CPU study's gpt-tiny), random weights and tokens, one evaluation of
--windows windows through lab.run.evaluation.evaluate at the batch eval_batch_size picks (and, for contrast, the
batch of before, 256 windows, unless it cannot fit); on CUDA the allocator's peak around each, with the
training state (FP32 weights) held as in a run. On a CPU there is no allocator peak: the evaluation runs and
the prediction is reported (the rehearsal).

    python benchmarks/gpu/eval_memory.py [--device cuda] [--tiny] --out eval_memory.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.models.presets import create_model  # noqa: E402
from lab.run.evaluation import eval_batch_size, evaluate  # noqa: E402


def predicted_gib(preset: str, vocab: int, context: int, batch: int) -> float:
    """sizing's trace of one evaluation batch (fake tensors: nothing allocated)."""
    import dataclasses

    from lab.core.config import load_study, resolve_run
    from lab.run import sizing
    study = load_study()
    cfg = resolve_run(study, "lm", "fp16-dynamic", 12)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=preset),
                              train=dataclasses.replace(cfg.train, batch_size=batch))
    return sizing.size_run(cfg, study, ("lm", vocab, 0, context)).eval_gib


def with_optimizer_state(model) -> torch.optim.Optimizer:
    """What a run holds while it evaluates, as lab/run/sizing.py counts it: the weights and the optimizer's state
    (the study's AdamW, made by one step on zero gradients, as sizing makes it)."""
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def measure(model, windows: int, batch: int, vocab: int, context: int, device: str) -> float | None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, vocab, (windows, context), generator=g),
                         torch.randint(0, vocab, (windows, context), generator=g))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    evaluate(model, DataLoader(data, batch_size=batch), device, "fp16", per_example=True)
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the CPU study's gpt-tiny (1024 words, context 32)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    preset, vocab, context = ("gpt-tiny", 1024, 32) if args.tiny else ("gpt2-small", 50257, 1024)
    model = create_model(preset, num_classes=vocab, in_chans=0, input_size=context).to(args.device)
    optimizer = with_optimizer_state(model)  # held while measuring: the prediction counts its state  # noqa: F841
    batch = eval_batch_size("lm", vocab, context, 8)
    report = {"device": args.device, "preset": preset, "vocab": vocab, "context": context, "windows": args.windows,
              "eval_batch": batch, "predicted_gib": predicted_gib(preset, vocab, context, 8),
              "measured_gib": measure(model, args.windows, batch, vocab, context, args.device)}
    old = max(256, 8)
    if args.device == "cuda" and old * context * vocab * 10 < 0.8 * torch.cuda.get_device_properties(0).total_memory:
        report["measured_gib_batch_256"] = measure(model, old, old, vocab, context, args.device)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

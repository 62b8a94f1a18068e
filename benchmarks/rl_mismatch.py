"""The sampler/learner mismatch as the sampler rounds at more points than the learner (docs/rl.md's table).

A random 4-layer GPT (width 128, vocabulary 256, context 64, seed 0), 32 prompts of 16 tokens, 32 tokens generated
by each sampler (lab/rl/paths.py), mean |log pi - log mu| against the learner (the training forward's points).

    python benchmarks/rl_mismatch.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.models.gpt import GPTConfig  # noqa: E402
from lab.rl import paths  # noqa: E402
from lab.rl.mismatch import mismatch  # noqa: E402

STEPS = [("none (only the KV cache and FP32's accumulation order differ)", set()),
         ("+ eager attention's scores and probabilities", {"attn_scores", "attn_probs"}),
         ("+ the residual stream", {"residual"}),
         ("+ weights, embeddings, LayerNorms", {"weights", "embed", "norm_out"})]


def main() -> int:
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=256, context=64, n_layer=4, n_head=4, d_model=128).build().eval()
    prompt = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(1))
    rows = {}
    for fmt in ("fp16", "bf16"):
        grown = set()
        for name, extra in STEPS:
            grown |= extra
            tokens, mu = paths.sample(model, prompt, 32, paths.Rounding(fmt, paths.LEARNER | grown),
                                      torch.Generator().manual_seed(2))
            rows.setdefault(name, {})[fmt] = mismatch(mu, paths.logprobs(model, tokens, 16, paths.learner(fmt)))
        for fuse in ((), ("residual_norm",), ("mlp",), ("head",), ("residual_norm", "mlp", "head")):
            tokens, mu = paths.sample(model, prompt, 32, paths.engine(fmt, fuse), torch.Generator().manual_seed(2))
            name = "the engine (attention fused)" + (f", fused: {' + '.join(fuse)}" if fuse else "")
            rows.setdefault(name, {})[fmt] = mismatch(mu, paths.logprobs(model, tokens, 16, paths.learner(fmt)))
    print("| sampler's extra rounding points | fp16 | bf16 | bf16 / fp16 |\n|---|---|---|---|")
    for name, m in rows.items():
        print(f"| {name} | {m['fp16']['abs_mean']:.2g} | {m['bf16']['abs_mean']:.3g} | "
              f"{m['bf16']['abs_mean'] / m['fp16']['abs_mean']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

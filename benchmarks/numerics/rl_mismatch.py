"""The sampler/learner mismatch as the sampler rounds at more points than the learner (docs/rl.md's table).

A random 4-layer GPT (width 128, vocabulary 256, context 64, seed 0), 32 prompts of 16 tokens, 32 tokens generated
by each sampler (lab/rl/paths.py), mean |log pi - log mu| against the learner (the training forward's points).

    python benchmarks/numerics/rl_mismatch.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.models.gpt import GPTConfig  # noqa: E402
from lab.rl import paths  # noqa: E402
from lab.rl.mismatch import PROB_BINS, mismatch  # noqa: E402

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
    by_length(model)
    by_probability()
    print("| sampler's extra rounding points | fp16 | bf16 | bf16 / fp16 |\n|---|---|---|---|")
    for name, m in rows.items():
        print(f"| {name} | {m['fp16']['abs_mean']:.2g} | {m['bf16']['abs_mean']:.3g} | "
              f"{m['bf16']['abs_mean'] / m['fp16']['abs_mean']:.1f} |")
    return 0


def by_length(model) -> None:
    """The engine against the learner over 48 generated tokens: the per-token |d| by position, and the sequence-level
    |sum of d| over the first L tokens (what sequence-level importance sampling weighs)."""
    prompt = torch.randint(0, 256, (64, 16), generator=torch.Generator().manual_seed(1))
    print("| format | per-token mean abs(d), tokens 1-8 / 41-48 | mean abs(sum of d) over the first 8 / 16 / 32 / 48 |")
    print("|---|---|---|")
    for fmt in ("fp16", "bf16"):
        tokens, mu = paths.sample(model, prompt, 48, paths.engine(fmt), torch.Generator().manual_seed(2))
        d = (paths.logprobs(model, tokens, 16, paths.learner(fmt)) - mu).double()
        seq = " / ".join(f"{float(d[:, :n].sum(1).abs().mean()):.2g}" for n in (8, 16, 32, 48))
        print(f"| {fmt} | {float(d[:, :8].abs().mean()):.2g} / {float(d[:, 40:].abs().mean()):.2g} | {seq} |")


def by_probability() -> None:
    """On a trained policy (the RL study's base, 400 steps on the addition task): |d| by the sampler's probability."""
    from lab.rl import task
    from lab.rl.grpo_run import pretrain_base
    model = pretrain_base(400, 0).eval()
    pairs = task.problems(512, torch.Generator().manual_seed(5))
    print("| format | mean abs(d) by the sampler's probability mu: " + " / ".join(
        f"({lo:g}, {hi:g}]" for lo, hi in zip((0,) + PROB_BINS[:-1], PROB_BINS)) + " (tokens) |\n|---|---|")
    for fmt in ("fp16", "bf16"):
        tokens, mu = paths.sample(model, task.prompts(pairs), task.ANSWER_LEN, paths.engine(fmt),
                                  torch.Generator().manual_seed(2))
        m = mismatch(mu, paths.logprobs(model, tokens, task.PROMPT_LEN, paths.learner(fmt)))
        print(f"| {fmt} | " + " / ".join(f"{b['abs_mean']:.2g} ({b['tokens']})" if b["tokens"] else "—"
                                         for b in m["by_prob"].values()) + " |")


if __name__ == "__main__":
    sys.exit(main())

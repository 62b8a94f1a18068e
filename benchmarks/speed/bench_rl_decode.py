"""The RL sampler's decode speed against a bare PyTorch KV-cache decode of the same model, side by side.

The lab's GPT (4 layers, width 128, vocabulary 1024, context 128, random weights), 64 prompts of 16 tokens, 96 tokens
generated. The sampler (lab/rl/paths.py ``sample``) computes in FP32 and rounds at the engine's points (fp16, and fp32:
no rounding); the bare decode is what one writes without the lab: the same weights, ``F.scaled_dot_product_attention``
over a growing KV cache, FP32, greedy-free multinomial sampling. The two alternate, ``--rounds`` times each; the ratio
is the median of per-round paired ratios (sampler time over bare time), on this machine's CPU.

    python benchmarks/speed/bench_rl_decode.py --out results/benchmarks/rl_decode.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.models.gpt import GPTConfig  # noqa: E402
from lab.rl import paths  # noqa: E402


@torch.no_grad()
def bare_decode(model, prompt: torch.Tensor, new: int, generator: torch.Generator) -> torch.Tensor:
    """A plain KV-cache decode of the lab's GPT: the prompt in one forward, then one token at a time."""
    cache = [None] * len(model.blocks)

    def step(idx, start):
        T = idx.shape[1]
        x = model.tok(idx) + model.pos(torch.arange(start, start + T))
        for i, blk in enumerate(model.blocks):
            B, _, C = x.shape
            H = blk.attn.n_head
            q, k, v = blk.attn.qkv(blk.ln1(x)).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
            if cache[i] is not None:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            cache[i] = (k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
            x = x + blk.attn.proj(y.transpose(1, 2).reshape(B, T, C))
            x = x + blk.mlp(blk.ln2(x))
        return model.head(model.ln_f(x))[:, -1]

    logits, tokens = step(prompt, 0), prompt
    for t in range(new):
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], 1)
        if t + 1 < new:
            logits = step(nxt, tokens.shape[1] - 1)
    return tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=1024, context=128, n_layer=4, n_head=4, d_model=128).build().eval()
    prompt = torch.randint(0, 1024, (64, 16), generator=torch.Generator().manual_seed(1))
    runs = {"bare": lambda g: bare_decode(model, prompt, 96, g),
            "sampler fp32": lambda g: paths.sample(model, prompt, 96, paths.engine("fp32"), g),
            "sampler fp16": lambda g: paths.sample(model, prompt, 96, paths.engine("fp16"), g)}
    times = {k: [] for k in runs}
    for r in range(a.rounds):
        for name, fn in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
            start = time.perf_counter()
            fn(torch.Generator().manual_seed(2))
            times[name].append(time.perf_counter() - start)
    tokens = 64 * 96
    result = {"tokens_per_round": tokens, "rounds": a.rounds, "threads": 1, "torch": torch.__version__,
              "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
              "ratio_to_bare": {k: statistics.median(t / b for t, b in zip(v, times["bare"]))
                                for k, v in times.items() if k != "bare"}, "times": times}
    for k, v in result["tokens_per_s"].items():
        print(f"{k:14s} {v:8.0f} tokens/s" + (f"  ({result['ratio_to_bare'][k]:.2f}x the bare decode's time)"
                                               if k != "bare" else ""))
    if a.out:
        files.atomic_write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

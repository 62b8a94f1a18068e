"""The mismatch's shape over a long generation (``python -m lab rl-shape``): how the sequence-level log-ratio and the
per-token mismatch change with the generated length, on random GPTs whose seeds are the independent units.

Per model seed and format (fp16, bf16): a random 4-layer GPT (width 128, vocabulary 256, context 64), 64 prompts of
16 random tokens, 48 tokens drawn by the inference engine's path (lab/rl/paths.py ``engine``), recomputed by the
learner's path; one row of shape.csv with the mean |sum of d| over the first 8, 16, 32 and 48 generated tokens
(``seq_abs_8`` ... ``seq_abs_48``: what sequence-level importance sampling weighs) and the per-token mean |d| over
tokens 1-8 and 41-48 (``tok_abs_first8``, ``tok_abs_last8``). A random model, not a trained one: the length effect
is the two paths' arithmetic, which needs no training; the probability effect needs a trained policy and is read
from the study's runs instead (metrics.json ``mismatch_low_prob`` / ``mismatch_high_prob``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from lab.core import files
from lab.models.gpt import GPTConfig
from lab.rl import paths

__all__ = ["shape", "COLUMNS", "LENGTHS"]

LENGTHS = (8, 16, 32, 48)
COLUMNS = ["mode", "seed", *(f"seq_abs_{n}" for n in LENGTHS), "tok_abs_first8", "tok_abs_last8"]


def one(seed: int, fmt: str, prompts: int = 64) -> dict:
    torch.manual_seed(seed)
    model = GPTConfig(vocab_size=256, context=64, n_layer=4, n_head=4, d_model=128).build().eval()
    prompt = torch.randint(0, 256, (prompts, 16), generator=torch.Generator().manual_seed(seed + 1))
    tokens, mu = paths.sample(model, prompt, LENGTHS[-1], paths.engine(fmt), torch.Generator().manual_seed(seed + 2))
    d = (paths.logprobs(model, tokens, 16, paths.learner(fmt)) - mu).double()
    return {"mode": fmt, "seed": seed, **{f"seq_abs_{n}": float(d[:, :n].sum(1).abs().mean()) for n in LENGTHS},
            "tok_abs_first8": float(d[:, :8].abs().mean()), "tok_abs_last8": float(d[:, -8:].abs().mean())}


def shape(seeds: list[int], out: Path) -> list[dict]:
    rows = [one(seed, fmt) for seed in seeds for fmt in ("fp16", "bf16")]
    files.atomic_write_csv(out, rows, COLUMNS)
    return rows

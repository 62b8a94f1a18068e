"""A task with a verifiable reward, generated: two-digit addition written out in characters.

A prompt is ``"37+45="``; the policy generates the answer's characters and ``;``; the reward is 1 when the generated
text up to the first ``;`` is the sum's digits (``"82"``), else 0. The base policy is a GPT pre-trained on such
lines (``37+45=82;``) for as many steps as it takes to solve some but not most of the prompts (20-80% at the start:
room for RL to raise the reward, and enough reward to learn from). Everything is generated from a seed: no download.
"""
from __future__ import annotations

import torch

__all__ = ["VOCAB", "PROMPT_LEN", "ANSWER_LEN", "encode", "decode", "problems", "prompts", "lines", "reward"]

CHARS = "0123456789+=;"
VOCAB = len(CHARS)
STOI = {c: i for i, c in enumerate(CHARS)}
PROMPT_LEN = 6          # "ab+cd="
ANSWER_LEN = 4          # up to three digits and ";"
END = STOI[";"]


def encode(text: str) -> list[int]:
    return [STOI[c] for c in text]


def decode(ids) -> str:
    return "".join(CHARS[int(i)] for i in ids)


def problems(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 2) pairs of two-digit numbers, 10-99."""
    return torch.randint(10, 100, (n, 2), generator=generator)


def prompts(pairs: torch.Tensor) -> torch.Tensor:
    """The prompts "ab+cd=" of ``pairs``: (n, PROMPT_LEN) token ids."""
    return torch.tensor([encode(f"{a}+{b}=") for a, b in pairs.tolist()])


def lines(pairs: torch.Tensor) -> torch.Tensor:
    """Whole lines "ab+cd=s;" padded with ";" to PROMPT_LEN + ANSWER_LEN: the base's pre-training text."""
    out = []
    for a, b in pairs.tolist():
        text = f"{a}+{b}={a + b};"
        out.append(encode(text + ";" * (PROMPT_LEN + ANSWER_LEN - len(text))))
    return torch.tensor(out)


def reward(pairs: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """1.0 where the generated characters up to the first ";" are the sum's digits, else 0.0 (no ";": 0)."""
    out = []
    for (a, b), ids in zip(pairs.tolist(), generated.tolist()):
        text = decode(ids)
        out.append(float(";" in text and text.split(";", 1)[0] == str(a + b)))
    return torch.tensor(out)

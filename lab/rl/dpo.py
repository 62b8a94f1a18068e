"""DPO on preference pairs from the embedded corpus: the real continuation preferred to a corrupted one.

A pair (``pairs``): a window of pydoc (the LM family's corpus, lab/data/text.py) cut into a prompt and a
continuation; ``chosen`` is the real continuation, ``rejected`` a corruption of it:

* ``bigram`` (the study's, lab/rl/dpo_run.py): ``k`` tokens of the continuation, at distinct positions, each replaced
  by a token drawn from the corpus's bigram distribution given the token before it (never the token it replaces), so
  the rejected text reads plausibly word by word and is wrong only where the replaced word meets its neighbours.
  The study's choice (configs/rl.yaml, dpo.train): k = 1, where its base (lab/rl/dpo_run.py: 300 FP32 steps of 16
  windows on pydoc's pretrain half) prefers the real continuation (FP32 sequence log-probabilities) in 71.1% of the
  256 held-out pairs (70-73% over three draws of 256; measured): room to learn. k = 2: 79-80%;
* ``unigram``: the same, the replacements drawn from the corpus's unigram distribution: easier, unlikely words stand
  out (the same base: 82-85% at k = 1, 95% at k = 3);
* ``shuffle``: the continuation's tokens in a random order (the same words, not the text): far too easy (the first
  look's base preferred the real text in 91% of held-out pairs before any DPO step; the study's base in 100%).

The reference policy is the frozen base. The loss (Rafailov et al. 2023) of a batch:

    -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))

with log pi(y) the sequence log-probability: the sum of the continuation's token log-probabilities. How that sum is
taken is the point of trl#878: ``sum_dtype`` float32 (the fix, TRL PR #942) or the run's 16-bit format (each token's
log-probability rounded to it and the sum accumulated in it, as an FP16 model's own output is summed when nothing
upcasts it). A continuation of 48 tokens at ~5 nats each sums to ~ -240, where FP16's spacing is 0.125 and bf16's 1.0:
the margins DPO learns from (a few tenths of a nat) drown in the rounding of the sum. What of it reaches the update:
the gradient passes the casts and additions unchanged (each has derivative 1), so the rounding moves each pair's
weight in the gradient, beta * sigmoid(-margin), not the direction of its token log-probabilities' gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import lab

__all__ = ["DPOConfig", "pairs", "token_table", "sequence_logprob", "dpo_loss", "dpo_forward", "dpo_step",
           "CORRUPTIONS"]

SUM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CORRUPTIONS = ("bigram", "unigram", "shuffle")


@dataclass
class DPOConfig:
    beta: float = 0.1
    learner: str = "fp32"       # the policy's (and the reference's) autocast format
    sum_dtype: str = "fp32"     # fp32 (the fix) | fp16 | bf16 (trl#878: the sequence sum in the 16-bit format)
    max_norm: float = 1.0

    def __post_init__(self):
        if self.sum_dtype not in SUM_DTYPES:
            raise ValueError(f"sum_dtype must be one of {', '.join(SUM_DTYPES)}, got {self.sum_dtype!r}")


def token_table(stream: torch.Tensor, vocab_size: int, corruption: str) -> torch.Tensor | None:
    """What a corruption draws replacements from: the stream's bigram counts (vocab x vocab: row a counts the tokens
    that follow a) for ``bigram``, its unigram counts (vocab) for ``unigram``, None for ``shuffle``."""
    if corruption == "shuffle":
        return None
    if corruption == "unigram":
        return torch.bincount(stream, minlength=vocab_size).double()
    if corruption == "bigram":
        counts = torch.zeros(vocab_size * vocab_size, dtype=torch.float64)
        counts.index_add_(0, stream[:-1] * vocab_size + stream[1:], torch.ones(len(stream) - 1, dtype=torch.float64))
        return counts.reshape(vocab_size, vocab_size)
    raise ValueError(f"corruption must be one of {', '.join(CORRUPTIONS)}, got {corruption!r}")


def pairs(stream: torch.Tensor, n: int, prompt: int, continuation: int, generator: torch.Generator,
          corruption: str = "shuffle", k: int = 1, table: torch.Tensor | None = None) -> dict:
    """``n`` pairs from a token stream: random windows of prompt + continuation tokens, the chosen continuation the
    real one, the rejected one its corruption (module docstring): ``shuffle`` (a different order for every pair), or
    ``k`` of its tokens replaced (``unigram`` / ``bigram``: drawn from ``table``, token_table's counts; by default
    the stream's own), the prompt and every other token kept."""
    length = prompt + continuation
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator)
    windows = torch.stack([stream[s: s + length] for s in starts.tolist()])
    if corruption == "shuffle":
        order = torch.argsort(torch.rand(n, continuation, generator=generator), dim=1)
        rejected = torch.cat([windows[:, :prompt], windows[:, prompt:].gather(1, order)], dim=1)
        return {"chosen": windows, "rejected": rejected, "prompt": prompt}
    if corruption not in CORRUPTIONS:
        raise ValueError(f"corruption must be one of {', '.join(CORRUPTIONS)}, got {corruption!r}")
    if not 1 <= k <= continuation:
        raise ValueError(f"k must be between 1 and the continuation's {continuation} tokens, got {k}")
    if table is None:
        table = token_table(stream, int(stream.max()) + 1, corruption)
    unigram = table if table.dim() == 1 else table.sum(dim=0)
    # k distinct positions per pair, replaced left to right (a bigram replacement follows the text as corrupted)
    where = prompt + torch.argsort(torch.rand(n, continuation, generator=generator), dim=1)[:, :k].sort(dim=1).values
    rejected, rows = windows.clone(), torch.arange(n)
    for j in range(k):
        pos = where[:, j]
        weights = (table[rejected[rows, pos - 1]] if table.dim() == 2 else unigram.expand(n, -1)).clone()
        weights[rows, windows[rows, pos]] = 0  # never the token it replaces
        empty = weights.sum(dim=1) == 0  # a token only ever followed by the one replaced: the unigram draw
        if bool(empty.any()):
            weights[empty] = unigram
            weights[rows[empty], windows[rows[empty], pos[empty]]] = 0
        rejected[rows, pos] = torch.multinomial(weights, 1, generator=generator)[:, 0]
    return {"chosen": windows, "rejected": rejected, "prompt": prompt}


def sequence_logprob(model, tokens: torch.Tensor, prompt: int, learner: str, sum_dtype: str,
                     device: str = "cpu") -> torch.Tensor:
    """log p(continuation | prompt) per sequence: the forward under lab.autocast(learner), token log-probabilities
    in FP32 from its logits, summed in ``sum_dtype`` (and returned as FP32)."""
    with lab.autocast(device, learner):
        logits = model(tokens[:, :-1])[:, prompt - 1:]
    token_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, prompt:, None])[..., 0]
    dtype = SUM_DTYPES[sum_dtype]
    if dtype == torch.float32:
        return token_logp.sum(dim=-1)
    total = torch.zeros(token_logp.shape[0], dtype=dtype, device=token_logp.device)
    for t in range(token_logp.shape[1]):  # accumulated in the 16-bit format, one rounding per addition
        total = total + token_logp[:, t].to(dtype)
    return total.float()


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean DPO loss and each pair's margin beta * ((pi_c - ref_c) - (pi_r - ref_r))."""
    margin = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return -F.logsigmoid(margin).mean(), margin.detach()


def dpo_forward(model, reference, cfg: DPOConfig, batch: dict, device: str = "cpu"):
    """The batch's DPO loss and margins: the reference's sequence log-probs (frozen, no gradient), the policy's."""
    p = batch["prompt"]
    with torch.no_grad():
        ref_c = sequence_logprob(reference, batch["chosen"], p, cfg.learner, cfg.sum_dtype, device)
        ref_r = sequence_logprob(reference, batch["rejected"], p, cfg.learner, cfg.sum_dtype, device)
    pi_c = sequence_logprob(model, batch["chosen"], p, cfg.learner, cfg.sum_dtype, device)
    pi_r = sequence_logprob(model, batch["rejected"], p, cfg.learner, cfg.sum_dtype, device)
    return dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta)


def dpo_step(model, reference, optimizer, scaler, cfg: DPOConfig, batch: dict, device: str = "cpu") -> dict:
    """One DPO step: dpo_forward, then the loss scaler's scale / unscale_ / clip / step / update (none in FP32 and
    bf16)."""
    loss, margin = dpo_forward(model, reference, cfg, batch, device)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return {"loss": loss, "margin": float(margin.mean()), "accuracy": float((margin > 0).float().mean()),
            "finite": bool(torch.isfinite(margin).all())}

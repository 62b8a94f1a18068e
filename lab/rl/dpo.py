"""DPO on preference pairs from the embedded corpus: the real continuation preferred to a corrupted one.

A pair (lab/rl/dpo.py ``pairs``): a window of pydoc (the LM family's corpus, lab/data/text.py) cut into a prompt and a
continuation; ``chosen`` is the real continuation, ``rejected`` the same tokens in a shuffled order (the same words,
not the text). The reference policy is the frozen base. The loss (Rafailov et al. 2023) of a batch:

    -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))

with log pi(y) the sequence log-probability: the sum of the continuation's token log-probabilities. How that sum is
taken is the point of trl#878: ``sum_dtype`` float32 (the fix, TRL PR #942) or the run's 16-bit format (each token's
log-probability rounded to it and the sum accumulated in it, as an FP16 model's own output is summed when nothing
upcasts it). A continuation of 48 tokens at ~5 nats each sums to ~ -240, where FP16's spacing is 0.125 and bf16's 1.0:
the margins DPO learns from (a few tenths of a nat) drown in the rounding of the sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import lab

__all__ = ["DPOConfig", "pairs", "sequence_logprob", "dpo_loss", "dpo_step"]

SUM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class DPOConfig:
    beta: float = 0.1
    learner: str = "fp32"       # the policy's (and the reference's) autocast format
    sum_dtype: str = "fp32"     # fp32 (the fix) | fp16 | bf16 (trl#878: the sequence sum in the 16-bit format)
    max_norm: float = 1.0

    def __post_init__(self):
        if self.sum_dtype not in SUM_DTYPES:
            raise ValueError(f"sum_dtype must be one of {', '.join(SUM_DTYPES)}, got {self.sum_dtype!r}")


def pairs(stream: torch.Tensor, n: int, prompt: int, continuation: int, generator: torch.Generator) -> dict:
    """``n`` pairs from a token stream: random windows of prompt + continuation tokens; the rejected continuation is
    the chosen one shuffled (a different order for every pair)."""
    length = prompt + continuation
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator)
    windows = torch.stack([stream[s: s + length] for s in starts.tolist()])
    order = torch.argsort(torch.rand(n, continuation, generator=generator), dim=1)
    rejected = torch.cat([windows[:, :prompt], windows[:, prompt:].gather(1, order)], dim=1)
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


def dpo_step(model, reference, optimizer, scaler, cfg: DPOConfig, batch: dict, device: str = "cpu") -> dict:
    """One DPO step: the reference's sequence log-probs (frozen, no gradient), the policy's, the loss, and the loss
    scaler's scale / unscale_ / clip / step / update (none in FP32 and bf16)."""
    p = batch["prompt"]
    with torch.no_grad():
        ref_c = sequence_logprob(reference, batch["chosen"], p, cfg.learner, cfg.sum_dtype, device)
        ref_r = sequence_logprob(reference, batch["rejected"], p, cfg.learner, cfg.sum_dtype, device)
    pi_c = sequence_logprob(model, batch["chosen"], p, cfg.learner, cfg.sum_dtype, device)
    pi_r = sequence_logprob(model, batch["rejected"], p, cfg.learner, cfg.sum_dtype, device)
    loss, margin = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta)
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

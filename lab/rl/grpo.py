"""GRPO on the arithmetic task (lab/rl/task.py): the sampler generates, the learner trains, a loss scaler scales.

One step: ``prompts`` problems, ``group`` samples each, drawn by the sampler's path (lab/rl/paths.py, its log-probs
mu); rewards; advantages normalised within each group (GRPO: (r - mean) / (std + 1e-6)); the learner's teacher-forced
forward under ``lab.autocast`` in its own precision (the training forward: log-probs pi, with gradients); the loss;
the scaled backward, unscale, clip, step and update of the loss scaler (or none in FP32 and bf16).

The loss, stated: each token's clipped surrogate min(r A, clip(r, 1 - eps, 1 + eps) A), times a correction's
weight (lab/rl/corrections: one file each, ``correction: {name: ..., ...}``):

* ``correction: none`` (the default): the behaviour policy is the sampler: the ratio r is pi / mu, clipped as PPO
  clips (Oat's and Qi et al.'s setting). A token whose mismatch alone puts pi / mu outside the band gets no gradient.
* any other correction: r is pi / pi_old, pi_old the learner's own recomputation (detached; one update per batch, so
  the ratio is 1 and only its gradient acts), and each token weighted by what the correction makes of
  rho_t = pi_old / mu: min(rho_t, C) for ``token-tis`` (token-level truncated importance sampling), a sequence's
  product of ratios for ``sequence-tis``, a rejection for ``token-mis``, ``sequence-mis``, ``geometric``.

``loss: grpo-tis`` is ``token-tis`` with C = ``tis_cap`` (verl's default C = 2), kept by that name.

Tokens count up to and including the first ``;`` of each sample (what the reward reads); the loss is their mean.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

import lab
from lab.rl import paths, task
from lab.rl.corrections import Correction, create_correction
from lab.rl.mismatch import mismatch

__all__ = ["GRPOConfig", "correction_spec", "Rollout", "rollout", "learner_loss", "grpo_step", "token_loss",
           "answer_mask", "advantages"]


@dataclass
class GRPOConfig:
    prompts: int = 16           # problems per step
    group: int = 8              # samples per problem
    eps: float = 0.2            # PPO's clip
    loss: str = "grpo"          # grpo | grpo-tis (grpo with correction token-tis, cap tis_cap)
    tis_cap: float = 2.0        # C of truncated importance sampling (grpo-tis)
    correction: Any = None      # a correction spec (lab/rl/corrections), under loss grpo; None: none
    sampler: str | dict = "fp32"  # the sampler's format (lab/rl/paths.py engine) or quantized line (lab/rl/samplers)
    learner: str = "fp32"       # the learner's autocast format
    fuse: tuple = ()            # the sampler's fused regions
    max_norm: float = 1.0       # gradient clipping, after unscale_
    corrector: Correction = field(init=False, repr=False, compare=False)  # the correction the two above name

    def __post_init__(self):
        if self.loss not in ("grpo", "grpo-tis"):
            raise ValueError(f"loss must be grpo or grpo-tis, got {self.loss!r}")
        if self.loss == "grpo-tis" and self.correction is not None:
            raise ValueError(f"loss grpo-tis is the token-tis correction already; name a correction under loss grpo "
                             f"instead, got correction {self.correction!r}")
        if self.group < 2:
            raise ValueError(f"group must be >= 2 (advantages are normalised within a group), got {self.group}")
        self.corrector = create_correction(correction_spec(self.loss, self.correction, self.tis_cap))

    @functools.cached_property
    def sampler_path(self) -> paths.Rounding:
        """The sampler's path, built once: a quantized KV cache's scales are kept over the run's rollouts."""
        from lab.rl.samplers import sampler_path
        return sampler_path(self.sampler, self.fuse)


def correction_spec(loss: str, correction=None, tis_cap: float = 2.0):
    """The correction a loss and a correction spec name: ``grpo-tis`` is ``token-tis`` with C = tis_cap; ``grpo``
    without one is ``none``."""
    if loss == "grpo-tis":
        return {"name": "token-tis", "cap": tis_cap}
    return "none" if correction is None else correction


def answer_mask(generated: torch.Tensor) -> torch.Tensor:
    """1.0 for each generated token up to and including the first ";" (all of them without one)."""
    end = (generated == task.END).int()
    before = torch.cumsum(end, dim=1) - end  # ends seen before this token
    return (before == 0).float()


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).flatten()


def token_loss(log_pi: torch.Tensor, log_mu: torch.Tensor, adv: torch.Tensor, cfg: GRPOConfig,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's loss (the negative clipped surrogate times the correction's weight), its ratio and the
    correction's keep mask (module docstring); ``mask``: the response tokens a sequence-level correction reads (all
    of them by default)."""
    old = log_pi.detach()
    weight, keep = cfg.corrector(old, log_mu, torch.ones_like(old, dtype=torch.bool) if mask is None else mask)
    ratio = torch.exp(log_pi - (log_mu if cfg.corrector.clip_against == "sampler" else old))
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.eps, 1 + cfg.eps) * adv)
    return -weight * surrogate, ratio, keep


@dataclass
class Rollout:
    """One step's samples: the tokens, the sampler's log-probs mu, rewards, advantages and the answer mask."""
    tokens: torch.Tensor
    log_mu: torch.Tensor
    rewards: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor


def rollout(model, cfg: GRPOConfig, pairs: torch.Tensor, generator: torch.Generator, device: str = "cpu") -> Rollout:
    """``group`` samples of each problem in ``pairs`` from the sampler's path, rewarded and advantaged."""
    pairs = pairs.repeat_interleave(cfg.group, dim=0)
    tokens, log_mu = paths.sample(model, task.prompts(pairs).to(device), task.ANSWER_LEN, cfg.sampler_path,
                                  generator)
    generated = tokens[:, task.PROMPT_LEN:]
    rewards = task.reward(pairs, generated.cpu()).to(device)
    return Rollout(tokens, log_mu, rewards, advantages(rewards, cfg.group)[:, None], answer_mask(generated))


def learner_loss(model, cfg: GRPOConfig, batch: Rollout, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    """The learner's forward under lab.autocast in its format, and the loss: the masked mean of the token losses;
    with it the log-probs pi and ratios (detached)."""
    generated = batch.tokens[:, task.PROMPT_LEN:]
    with lab.autocast(device, cfg.learner):
        logits = model(batch.tokens[:, :-1])[:, task.PROMPT_LEN - 1:]
    log_pi = torch.log_softmax(logits.float(), dim=-1).gather(-1, generated[..., None])[..., 0]
    per_token, ratio, keep = token_loss(log_pi, batch.log_mu, batch.adv, cfg, batch.mask)
    loss = (per_token * batch.mask).sum() / batch.mask.sum()  # a rejected token counts here, with weight 0
    return loss, {"log_pi": log_pi.detach(), "ratio": ratio.detach(), "keep": keep}


def grpo_step(model, optimizer, scaler, cfg: GRPOConfig, pairs: torch.Tensor, generator: torch.Generator,
              device: str = "cpu", divisor: int = 1, batch: Rollout | None = None) -> dict:
    """One GRPO step on problems ``pairs`` (or a ``batch`` already rolled out); returns its loss (a tensor), the
    rollout and host numbers: reward, mismatch, the share of tokens outside the clip band, the share the correction
    kept.

    ``divisor``: the loss is divided by it before the (scaled) backward and the gradients multiplied back in FP32
    after unscale_: the FP16 magnitudes of a backward that is one of ``divisor`` accumulated micro-batches (the LM
    family's ``emulated_accum``, docs/lm-regime.md), the FP32 update unchanged."""
    batch = batch if batch is not None else rollout(model, cfg, pairs, generator, device)
    loss, seen = learner_loss(model, cfg, batch, device)
    params = [p for p in model.parameters() if p.requires_grad]
    (scaler.scale(loss / divisor) if scaler is not None else loss / divisor).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if divisor != 1:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], float(divisor))
    torch.nn.utils.clip_grad_norm_(params, cfg.max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    keep = batch.mask.bool()
    m = mismatch(batch.log_mu, seen["log_pi"], batch.mask, eps=cfg.eps)  # per sequence: the answer mask's rows
    return {"loss": loss, "batch": batch, "reward": float(batch.rewards.mean()), "mismatch": m,
            "abs_d": (seen["log_pi"] - batch.log_mu)[keep].abs(), "mu": batch.log_mu[keep].exp(),
            "clipped": float(((seen["ratio"] - 1).abs() > cfg.eps)[keep].float().mean()),
            "kept": float(seen["keep"][keep].float().mean())}

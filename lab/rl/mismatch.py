"""The sampler/learner mismatch: how far the log-probabilities the sampler reported (mu) are from those the learner
recomputes (pi) for the same generated tokens.

Per token, d = log pi - log mu and the importance weight w = pi / mu. Reported (``mismatch``):

* ``abs_mean``, ``abs_p99``, ``abs_max``: |d| over the generated tokens; ``by_prob``: its mean in bins of the
  sampler's probability mu (low-probability tokens carry the larger relative error);
* ``k1``: mean(log mu - log pi), the estimator Qi et al. log as ``kl_sample_train_v1``; ``k3``: mean(w - 1 - log w),
  Schulman's unbiased, non-negative estimator of KL(mu || pi);
* ``out_of_band``: the share of tokens with w outside [1 - eps, 1 + eps] (PPO's clip band, eps 0.2) and
  ``out_of_half_double`` outside [0.5, 2] (truncated importance sampling at C = 2 cuts above 2);
* ``ess``: the importance weights' effective sample size over the tokens, (sum w)^2 / (n sum w^2), 1 when they
  all agree;
* ``seq_abs_mean``: the mean over sequences of |sum of d| (the sequence-level log-ratio that sequence-level IS uses).
"""
from __future__ import annotations

import torch

__all__ = ["mismatch", "PROB_BINS"]

#: bins of the sampler's probability mu for ``by_prob`` (upper edges)
PROB_BINS = (0.01, 0.1, 0.5, 1.0)


def mismatch(log_mu: torch.Tensor, log_pi: torch.Tensor, eps: float = 0.2) -> dict:
    """The mismatch of (batch, tokens) log-probabilities (module docstring); FP64 arithmetic, host numbers."""
    if log_mu.shape != log_pi.shape:
        raise ValueError(f"log_mu {tuple(log_mu.shape)} and log_pi {tuple(log_pi.shape)} differ in shape")
    mu, pi = log_mu.double(), log_pi.double()
    d = pi - mu
    a = d.abs().flatten()
    w = d.exp()
    prob = mu.exp().flatten()
    by_prob, lo = {}, 0.0
    for hi in PROB_BINS:
        sel = (prob > lo) & (prob <= hi)
        by_prob[f"({lo:g}, {hi:g}]"] = {"tokens": int(sel.sum()), "abs_mean": float(a[sel].mean()) if sel.any()
                                        else None}
        lo = hi
    return {"tokens": a.numel(), "abs_mean": float(a.mean()), "abs_p99": float(torch.quantile(a, 0.99)),
            "abs_max": float(a.max()), "by_prob": by_prob, "k1": float((-d).mean()),
            "k3": float((w - 1 - d).mean()),
            "out_of_band": float(((w < 1 - eps) | (w > 1 + eps)).double().mean()),
            "out_of_half_double": float(((w < 0.5) | (w > 2.0)).double().mean()),
            "ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
            "seq_abs_mean": float(d.sum(dim=-1).abs().mean())}

"""The sampler/learner mismatch: how far the log-probabilities the sampler reported (mu) are from those the learner
recomputes (pi) for the same generated tokens, teacher-forced and paired token by token.

Per token, d = log pi - log mu and the importance weight w = pi / mu (verl's rho). The tokens are those a response
mask keeps (``mask``: padding and the tokens after the answer left out; all of them without one); every mean over
tokens is over the kept tokens of the whole batch (verl's ``masked_mean``), a sequence is a row of the batch.

Under verl's names (verl logs them as ``rollout_corr/<name>``; verl/trainer/ppo/rollout_corr_helper.py):

* ``kl``: mean(log mu - log pi), the direct estimator of KL(mu || pi) (``compute_offpolicy_metrics``' ``kl``);
* ``k3_kl``: mean(w - 1 - log w), Schulman's non-negative estimator of the same KL (its ``k3_kl``);
* ``chi2_token``: mean(w^2) - 1, w from d clamped to [-20, 20] as verl clamps (its ``chi2_token``);
* ``chi2_seq``: the mean over sequences of (prod_t w_t)^2 - 1, computed as exp(2 * clamp(sum_t d_t, -20, 20)) in
  log space (its ``chi2_seq``; verl also counts a row the mask empties, as 1: here it is no sequence);
* ``rollout_is_eff_sample_size``: with the weights clamped to [1/C, C] (C = ``is_threshold``, verl's
  ``rollout_is_threshold``, default 2), mean(w)^2 / mean(w^2): 1 when they all agree (``compute_is_metrics`` at
  token level, which writes it 1 / mean((w / mean w)^2));

equal to verl's up to its 1e-8 guards against a zero divisor. The lab's own, without a verl name:

* ``p_abs_diff_max``: max |mu - pi| in probability space, exp(log mu) - exp(log pi);
* ``out_of_c2``, ``out_of_c3``, ``out_of_c5``: the share of tokens with w outside [1/C, C] (verl's
  ``rollout_is_ratio_fraction_high`` + ``rollout_is_ratio_fraction_low`` at token level, threshold C);
* ``abs_mean``, ``abs_p99``, ``abs_max``: |d| over the tokens;
* ``k1`` and ``k3``: ``kl`` and ``k3_kl`` under the names the RL study's tables were written with (k1 is the estimator
  Qi et al. log as ``kl_sample_train_v1``); ``ess``: the unclamped weights' (sum w)^2 / (n sum w^2);
* ``out_of_band``: the share with w outside [1 - eps, 1 + eps] (PPO's clip band); ``out_of_half_double``: outside
  [0.5, 2], the same number as ``out_of_c2``;
* ``seq_abs_mean``: the mean over sequences of |sum_t d_t| (the log of the weight sequence-level IS uses);
* ``by_prob`` and ``by_position``: the per-token statistics (tokens, abs_mean, kl, k3_kl, chi2_token,
  p_abs_diff_max, rollout_is_eff_sample_size, out_of_c*) in bins of the sampler's probability mu (low-probability
  tokens carry the larger relative error) and of the token's position in the response (its column), None in a bin
  no token fell in.
"""
from __future__ import annotations

import torch

__all__ = ["mismatch", "PROB_BINS", "CAPS", "SAFETY_BOUND", "position_bins"]

#: bins of the sampler's probability mu for ``by_prob`` (upper edges; each bin (previous edge, edge])
PROB_BINS = (0.01, 0.1, 0.5, 1.0)
#: the bands [1/C, C] whose out-of-band shares are reported (``out_of_c2`` ...): C = 2 is truncated importance
#: sampling's usual cap (FlashRL, verl's default threshold), 3 TRL's default clip, 5 IcePop's upper bound
CAPS = (2.0, 3.0, 5.0)
#: verl's bound on a log-ratio before it is exponentiated in chi-squared (exp(40) ~ 2e17 caps one sequence's term)
SAFETY_BOUND = 20.0
_TOKEN_KEYS = ("abs_mean", "kl", "k3_kl", "chi2_token", "p_abs_diff_max", "rollout_is_eff_sample_size",
               *(f"out_of_c{c:g}" for c in CAPS))


def position_bins(length: int) -> list[tuple[int, int]]:
    """The ``by_position`` bins [lo, hi) for responses of ``length`` columns: [0, 1), [1, 2), [2, 4), [4, 8), ...,
    doubling until one holds the last column."""
    bins, lo, hi = [], 0, 1
    while lo < length:
        bins.append((lo, hi))
        lo, hi = hi, 2 * hi
    return bins


def _token_stats(log_mu: torch.Tensor, log_pi: torch.Tensor, is_threshold: float) -> dict:
    """The per-token statistics (module docstring) of tokens given as 1-D FP64 log-probabilities; None each when
    there are none."""
    if log_mu.numel() == 0:
        return {"tokens": 0, **dict.fromkeys(_TOKEN_KEYS)}
    d = log_pi - log_mu
    w = d.exp()
    rho = d.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    capped = w.clamp(1 / is_threshold, is_threshold)
    return {"tokens": d.numel(), "abs_mean": float(d.abs().mean()), "kl": float((-d).mean()),
            "k3_kl": float((w - 1 - d).mean()), "chi2_token": float((rho * rho).mean() - 1),
            "p_abs_diff_max": float((log_mu.exp() - log_pi.exp()).abs().max()),
            "rollout_is_eff_sample_size": float(capped.mean() ** 2 / (capped * capped).mean()),
            **{f"out_of_c{c:g}": float(((w < 1 / c) | (w > c)).double().mean()) for c in CAPS}}


def _kept(log_mu: torch.Tensor, log_pi: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The response mask as booleans (all tokens without one), refused when it does not fit or keeps nothing."""
    if log_mu.shape != log_pi.shape:
        raise ValueError(f"log_mu {tuple(log_mu.shape)} and log_pi {tuple(log_pi.shape)} differ in shape")
    if mask is None:
        return torch.ones(log_mu.shape, dtype=torch.bool, device=log_mu.device)
    if mask.shape != log_mu.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and the log-probs {tuple(log_mu.shape)} differ in shape")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must hold 0 and 1 (or booleans): a token is in the response or not")
    keep = mask.bool()
    if not keep.any():
        raise ValueError("the mask keeps no token")
    return keep


def mismatch(log_mu: torch.Tensor, log_pi: torch.Tensor, mask: torch.Tensor | None = None, *, eps: float = 0.2,
             is_threshold: float = 2.0) -> dict:
    """The mismatch of (batch, tokens) log-probabilities over the tokens ``mask`` keeps (module docstring); FP64
    arithmetic, host numbers."""
    keep = _kept(log_mu, log_pi, mask)
    mu, pi = log_mu.double(), log_pi.double()
    mu_t, pi_t = mu[keep], pi[keep]  # the kept tokens, row by row
    d = pi_t - mu_t
    a, w = d.abs(), d.exp()
    stats = _token_stats(mu_t, pi_t, is_threshold)
    per_seq = torch.where(keep, pi - mu, 0.0).sum(dim=-1)[keep.any(dim=-1)]  # sum_t d_t of each sequence
    prob, by_prob, lo = mu_t.exp(), {}, 0.0
    for hi in PROB_BINS:
        sel = (prob > lo) & (prob <= hi)
        by_prob[f"({lo:g}, {hi:g}]"] = _token_stats(mu_t[sel], pi_t[sel], is_threshold)
        lo = hi
    pos = torch.arange(keep.shape[-1], device=keep.device).expand(keep.shape)[keep]
    by_position = {f"[{lo}, {hi})": _token_stats(mu_t[(pos >= lo) & (pos < hi)], pi_t[(pos >= lo) & (pos < hi)],
                                                 is_threshold) for lo, hi in position_bins(keep.shape[-1])}
    return {**stats, "abs_p99": float(torch.quantile(a, 0.99)), "abs_max": float(a.max()), "k1": stats["kl"],
            "k3": stats["k3_kl"], "chi2_seq": float(torch.exp(2 * per_seq.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean()
                                                   - 1),
            "out_of_band": float(((w < 1 - eps) | (w > 1 + eps)).double().mean()),
            "out_of_half_double": stats["out_of_c2"], "ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
            "seq_abs_mean": float(per_seq.abs().mean()), "by_prob": by_prob, "by_position": by_position}

"""lab/rl/mismatch.py's metrics against their closed forms and against verl's formulas written out in FP64.

Closed forms: identical log-probs give no mismatch at all; a constant log-ratio d per token gives kl = -d,
k3_kl = e^d - 1 - d, chi2_token = e^(2d) - 1, a sequence of L tokens (prod w)^2 - 1 = e^(2Ld) - 1, equal weights an
effective sample size of 1, max |mu - pi| = max mu |1 - e^d|. The log-probs are dyadic (multiples of 1/8) so that
pi - mu is d exactly: what is left is FP64's rounding of exp and of a mean, bounded by n * eps for n terms.

verl (verl/trainer/ppo/rollout_corr_helper.py, ``compute_offpolicy_metrics`` and ``compute_is_metrics`` at token
level, with verl/utils/torch_functional.py's ``masked_sum`` / ``masked_mean``) is not installed here: its lines are
written out below as verl writes them, guards included; the two agree within what verl's 1e-8 guards move.
"""
import math

import pytest
import torch

from lab.rl.mismatch import CAPS, PROB_BINS, SAFETY_BOUND, mismatch, position_bins

EPS64 = torch.finfo(torch.float64).eps
VERL_GUARD = 1e-8  # verl's masked_mean divides by (count + 1e-8) and its ESS by (mean + 1e-8)


def dyadic_batch(rows=6, cols=9, seed=0):
    """Log-probs log mu in [-6, -0.125] on a grid of 1/8 and a ragged response mask (row i keeps its first
    1 + i % cols tokens; every row keeps one)."""
    g = torch.Generator().manual_seed(seed)
    log_mu = -torch.randint(1, 49, (rows, cols), generator=g).double() / 8
    lengths = torch.tensor([1 + i % cols for i in range(rows)])
    mask = (torch.arange(cols)[None] < lengths[:, None]).double()
    return log_mu, mask, lengths


def test_identical_log_probs_have_no_mismatch():
    log_mu, mask, _ = dyadic_batch()
    m = mismatch(log_mu, log_mu.clone(), mask)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "p_abs_diff_max", "abs_max", "seq_abs_mean",
                *(f"out_of_c{c:g}" for c in CAPS)):
        assert m[key] == 0.0, key
    assert m["rollout_is_eff_sample_size"] == 1.0 and m["ess"] == 1.0 and m["out_of_band"] == 0.0


@pytest.mark.parametrize("d", [-1.75, -0.375, 0.0625, 0.875, 1.625])
def test_a_constant_log_ratio_gives_the_closed_forms(d):
    log_mu, mask, lengths = dyadic_batch()
    m = mismatch(log_mu, log_mu + d, mask)
    n = int(mask.sum())
    tol = n * EPS64
    assert m["tokens"] == n and m["kl"] == pytest.approx(-d, rel=tol)
    # exp's rounding, then a difference that cancels to the small result: bounded in absolute terms
    assert m["k3_kl"] == pytest.approx(math.expm1(d) - d, rel=tol, abs=4 * EPS64 * (math.exp(d) + 1 + abs(d)))
    assert m["chi2_token"] == pytest.approx(math.expm1(2 * d), rel=tol, abs=4 * EPS64 * (math.exp(2 * d) + 1))
    want_seq = sum(math.exp(2 * int(L) * d) for L in lengths) / len(lengths) - 1  # every |L d| <= 20 here
    assert m["chi2_seq"] == pytest.approx(want_seq, rel=64 * tol)
    assert m["seq_abs_mean"] == pytest.approx(float(lengths.double().mean()) * abs(d), rel=tol)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.0, rel=tol) and m["ess"] == pytest.approx(1.0, rel=tol)
    assert m["p_abs_diff_max"] == pytest.approx(math.exp(float(log_mu[mask.bool()].max())) * abs(math.expm1(d)),
                                                rel=8 * tol)
    for c in CAPS:  # the band [1/C, C] in w = e^d: every token in or every token out
        assert m[f"out_of_c{c:g}"] == (0.0 if -math.log(c) <= d <= math.log(c) else 1.0), c
    assert m["k1"] == m["kl"] and m["k3"] == m["k3_kl"] and m["out_of_half_double"] == m["out_of_c2"]


def test_padding_and_the_tokens_after_the_answer_change_nothing():
    """Columns past the answer and a row the mask empties, filled with anything (inf, NaN, huge), are not read."""
    log_mu, mask, _ = dyadic_batch()
    log_pi = log_mu + torch.randn(log_mu.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = mismatch(log_mu, log_pi, mask)
    junk = torch.tensor([[float("nan"), float("-inf"), 1e300, -7.0]], dtype=torch.float64)
    wide_mu = torch.cat([torch.cat([log_mu, junk.expand(len(log_mu), -1)], 1), junk.repeat(1, 4)[:, :13]], 0)
    wide_pi = torch.cat([torch.cat([log_pi, -junk.expand(len(log_pi), -1)], 1), junk.repeat(1, 4)[:, :13]], 0)
    wide_mask = torch.zeros(wide_mu.shape, dtype=torch.float64)
    wide_mask[:len(mask), :mask.shape[1]] = mask
    got = mismatch(wide_mu, wide_pi, wide_mask)
    n = int(mask.sum())
    for key, value in want.items():
        if key in ("by_prob", "by_position"):
            continue
        assert got[key] == pytest.approx(value, rel=64 * n * EPS64, abs=0), key  # a sum's order, nothing more
    assert got["by_prob"] == want["by_prob"]
    assert all(got["by_position"][k] == v for k, v in want["by_position"].items())
    assert all(v["tokens"] == 0 for k, v in got["by_position"].items() if k not in want["by_position"])


def verl_masked_sum(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum() if axis is None else (valid * mask).sum(dim=axis)


def verl_masked_mean(values, mask, axis=None):
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return verl_masked_sum(values, mask, axis) / (count + VERL_GUARD)


def verl_metrics(old_log_prob, rollout_log_prob, response_mask, threshold):
    """compute_offpolicy_metrics' kl, k3_kl, chi2_token, chi2_seq and compute_is_metrics' (token level)
    rollout_is_eff_sample_size and ratio fractions, line for line, in FP64."""
    out = {"kl": verl_masked_mean(rollout_log_prob - old_log_prob, response_mask)}
    log_ratio = old_log_prob - rollout_log_prob
    out["k3_kl"] = verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask)
    rho_token = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    out["chi2_token"] = verl_masked_mean(rho_token.square(), response_mask) - 1.0
    log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1)
    out["chi2_seq"] = torch.exp(2.0 * torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).mean() - 1.0
    weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * response_mask
    capped = weights.clamp(min=1.0 / threshold, max=threshold)
    normalized = capped / (verl_masked_mean(capped, response_mask) + VERL_GUARD)
    out["rollout_is_eff_sample_size"] = 1.0 / verl_masked_mean(normalized.square(), response_mask)
    out["fraction_high"] = verl_masked_mean((weights > threshold).double(), response_mask)
    out["fraction_low"] = verl_masked_mean((weights < 1.0 / threshold).double(), response_mask)
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("scale", [0.05, 0.7, 6.0])
@pytest.mark.parametrize("threshold", CAPS)
def test_the_verl_named_metrics_are_verls_formulas(scale, threshold):
    g = torch.Generator().manual_seed(11)
    log_mu = torch.log_softmax(3 * torch.randn(8, 12, 32, generator=g, dtype=torch.float64), -1)[..., 0]
    log_pi = log_mu + scale * torch.randn(log_mu.shape, generator=g, dtype=torch.float64)
    mask = (torch.arange(12)[None] < torch.randint(1, 13, (8, 1), generator=g)).double()
    log_pi[0], mask[0] = log_mu[0] + 2.5, 1.0  # a sequence whose log-ratio, 30, is past verl's bound of 20
    m, v = mismatch(log_mu, log_pi, mask, is_threshold=threshold), verl_metrics(log_pi, log_mu, mask, threshold)
    n = int(mask.sum())
    guard = 8 * VERL_GUARD + 64 * n * EPS64  # what verl's guards and FP64's sums of n terms move
    assert m["kl"] == pytest.approx(v["kl"], rel=guard) and m["k3_kl"] == pytest.approx(v["k3_kl"], rel=guard)
    assert m["chi2_token"] == pytest.approx(v["chi2_token"], abs=guard * (1 + abs(v["chi2_token"])))
    assert m["chi2_seq"] == pytest.approx(v["chi2_seq"], rel=64 * n * EPS64 * (1 + 2 * SAFETY_BOUND))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(v["rollout_is_eff_sample_size"], rel=guard)
    share = m[f"out_of_c{threshold:g}"]
    assert share == pytest.approx(v["fraction_high"] + v["fraction_low"], rel=guard)
    assert share > 0 and m["chi2_seq"] > math.exp(2 * SAFETY_BOUND) / 8 / 2  # not zeros; the bound is reached


def test_the_bins_by_sampler_probability_and_by_position():
    """One log-ratio per probability bin (and then one per position bin): each bin's kl and k3_kl are its own."""
    edges = (0.0,) + PROB_BINS
    mus = torch.tensor([[(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]] * 3, dtype=torch.float64)
    ds = torch.tensor([-0.5, 0.25, 1.0, -2.0], dtype=torch.float64)
    m = mismatch(mus.log(), mus.log() + ds, torch.tensor([[1.0] * 4, [1.0] * 4, [1.0, 1.0, 0.0, 0.0]]))
    for (lo, hi), d, n in zip(zip(edges, edges[1:]), ds.tolist(), (3, 3, 2, 2)):
        cell = m["by_prob"][f"({lo:g}, {hi:g}]"]
        assert cell["tokens"] == n and cell["kl"] == pytest.approx(-d) and cell["k3_kl"] == pytest.approx(
            math.expm1(d) - d) and cell["abs_mean"] == pytest.approx(abs(d))
    assert position_bins(4) == [(0, 1), (1, 2), (2, 4)] and position_bins(5)[-1] == (4, 8)
    by_pos = m["by_position"]
    assert [by_pos[k]["tokens"] for k in ("[0, 1)", "[1, 2)", "[2, 4)")] == [3, 3, 4]
    assert by_pos["[0, 1)"]["kl"] == pytest.approx(0.5) and by_pos["[2, 4)"]["kl"] == pytest.approx(0.5)
    assert by_pos["[2, 4)"]["chi2_token"] == pytest.approx((math.exp(2) + math.exp(-4)) / 2 - 1)
    empty = mismatch(torch.full((1, 2), math.log(0.9)), torch.full((1, 2), math.log(0.9)))["by_prob"]["(0, 0.01]"]
    assert empty["tokens"] == 0 and empty["kl"] is None


def test_bad_masks_are_refused():
    log_mu = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch(log_mu, log_mu, torch.ones(2, 2))
    with pytest.raises(ValueError, match="keeps no token"):
        mismatch(log_mu, log_mu, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="0 and 1"):
        mismatch(log_mu, log_mu, torch.full((2, 3), 0.5))

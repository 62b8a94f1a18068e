"""Evaluation in bounded memory: the validation batch is sized so that its logits fit
lab.run.evaluation.EVAL_LOGITS_BUDGET (GPT-2 small's 256 windows x 1024 tokens x 50,257 logits would not fit an
80 GB GPU), its scores do not depend on that batch size, and a sharded run's ranks each score a slice that,
gathered, is the set."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from lab.models.gpt import GPTConfig
from lab.run.evaluation import (EVAL_LOGIT_BYTES, EVAL_LOGITS_BUDGET, eval_batch_size, evaluate, evaluate_sharded,
                                rank_slice)


def test_the_lm_evaluation_batch_fits_the_budget_and_small_models_keep_theirs():
    gpt2 = eval_batch_size("lm", 50257, 1024, batch_size=8)
    assert 1 <= gpt2 < 256 and gpt2 * 1024 * 50257 * EVAL_LOGIT_BYTES <= EVAL_LOGITS_BUDGET
    assert (gpt2 + 1) * 1024 * 50257 * EVAL_LOGIT_BYTES > EVAL_LOGITS_BUDGET  # the largest that fits
    assert eval_batch_size("lm", 1024, 32, batch_size=32) == 256        # the CPU study's LM: as before
    assert eval_batch_size("classify", 1000, 224, batch_size=1024) == 1024  # ImageNet: the training batch
    assert eval_batch_size("lm", 10**9, 10**6, batch_size=8) == 1          # never zero


def _lm_and_windows(n: int = 13, context: int = 8, vocab: int = 50):
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=vocab, context=context, n_layer=1, n_head=2, d_model=16).build().double()
    x = torch.randint(0, vocab, (n, context))
    y = torch.randint(0, vocab, (n, context))
    return model, TensorDataset(x, y)


@pytest.mark.parametrize("batch", [1, 4, 13])
def test_scores_do_not_depend_on_the_evaluation_batch(batch):
    model, data = _lm_and_windows()
    ref = evaluate(model, DataLoader(data, batch_size=len(data)), "cpu", "fp32", per_example=True)
    got = evaluate(model, DataLoader(data, batch_size=batch), "cpu", "fp32", per_example=True)
    assert len(got[2]) == len(data) * 8
    np.testing.assert_array_equal(got[2], ref[2])
    # float32 outcomes of a float64 model: FP64 sums in another order, rounded once to FP32: at most one FP32 ulp apart
    np.testing.assert_allclose(got[3], ref[3], rtol=torch.finfo(torch.float32).eps, atol=0)
    assert got[0] == ref[0] and got[1] == pytest.approx(ref[1], rel=1e-12)


@pytest.mark.parametrize("n,world", [(13, 2), (12, 2), (7, 3), (1, 2)])
def test_rank_slices_cover_the_set_once_and_are_equally_long(n, world):
    slices = [rank_slice(n, r, world) for r in range(world)]
    assert len({len(s) for s in slices}) == 1                 # the same number of collective forwards
    flat = [i for s in slices for i in s]
    assert flat[:n] == list(range(n)) and set(flat[n:]) <= {n - 1}  # in order, then padding only


class _TwoRanks:
    """Dist of rank 0 in a world of two, rank 1's outcomes computed beforehand (its gather's other half)."""
    enabled, world, rank = True, 2, 0

    def __init__(self, other):
        self.other = other

    def gather(self, obj):
        return [obj, self.other]


def test_sharded_evaluation_gathers_to_the_whole_sets_scores():
    model, data = _lm_and_windows(n=13)
    whole = evaluate(model, DataLoader(data, batch_size=4), "cpu", "fp32", per_example=True)
    loaders = [DataLoader(Subset(data, rank_slice(len(data), r, 2)), batch_size=4) for r in range(2)]
    rank1 = evaluate(model, loaders[1], "cpu", "fp32", per_example=True)[2:]
    top1, loss, correct, losses = evaluate_sharded(model, loaders[0], "cpu", "fp32", _TwoRanks(rank1), len(data))
    np.testing.assert_array_equal(correct, whole[2])
    np.testing.assert_allclose(losses, whole[3], rtol=torch.finfo(torch.float32).eps, atol=0)  # one FP32 ulp, above
    assert top1 == pytest.approx(whole[0]) and loss == pytest.approx(whole[1], rel=1e-6)

"""DPO (lab/rl/dpo.py): pairs from a token stream, the sequence log-probability summed in FP32 or in the 16-bit format
(trl#878), the loss by hand, and steps that raise the preferred continuation's margin."""
import copy
import math

import pytest
import torch

from lab.models.gpt import GPTConfig
from lab.rl.dpo import DPOConfig, dpo_loss, dpo_step, pairs, sequence_logprob


def model(seed=0):
    torch.manual_seed(seed)
    return GPTConfig(vocab_size=64, context=64, n_layer=2, n_head=4, d_model=32).build()


def stream(n=4000):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(3))


def test_pairs_prefer_the_real_continuation_to_its_shuffle():
    p = pairs(stream(), 8, 16, 48, torch.Generator().manual_seed(0))
    assert p["chosen"].shape == p["rejected"].shape == (8, 64)
    assert torch.equal(p["chosen"][:, :16], p["rejected"][:, :16])  # the same prompt
    assert torch.equal(p["chosen"][:, 16:].sort(dim=1).values, p["rejected"][:, 16:].sort(dim=1).values)
    assert not torch.equal(p["chosen"], p["rejected"])


@pytest.mark.parametrize("fmt,spacing", [("fp16", 2.0 ** -3), ("bf16", 2.0 ** 0)])
def test_a_sixteen_bit_sum_loses_what_the_fp32_sum_keeps(fmt, spacing):
    """48 tokens of a random model's ~4 nats each: the FP32 sum is the sum; the 16-bit sum rounds each partial sum
    to the format (its spacing near 2^7-2^8: 2^-3 in fp16, 1 in bf16), so it lands on that grid and is off by up to
    48 half-spacings."""
    m, p = model(), pairs(stream(), 8, 16, 48, torch.Generator().manual_seed(0))
    exact = sequence_logprob(m, p["chosen"], 16, "fp32", "fp32")
    with torch.no_grad():
        logits = m(p["chosen"][:, :-1])[:, 15:]
    by_hand = torch.log_softmax(logits, -1).gather(-1, p["chosen"][:, 16:, None])[..., 0].double().sum(-1)
    assert torch.allclose(exact.double(), by_hand, atol=1e-4)
    assert bool((exact < -128).all() and (exact > -256).all())  # where the spacing below holds
    rounded = sequence_logprob(m, p["chosen"], 16, "fp32", fmt)
    err = (rounded.double() - by_hand).abs()
    assert float(err.max()) <= 48 * spacing / 2 + 1e-6 and float(err.max()) > 1e-3
    assert torch.equal(rounded, rounded.to({"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]).float())


def test_the_loss_by_hand():
    loss, margin = dpo_loss(torch.tensor([-10.0, -20.0]), torch.tensor([-12.0, -19.0]), torch.tensor([-11.0, -20.0]),
                            torch.tensor([-11.0, -20.0]), beta=0.5)
    assert margin.tolist() == pytest.approx([0.5 * (1 + 1), 0.5 * (0 - 1)])
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2)
    with pytest.raises(ValueError, match="sum_dtype must be one of fp32, fp16, bf16"):
        DPOConfig(sum_dtype="int8")


def test_dpo_steps_raise_the_margin_of_the_preferred_continuation():
    policy, p = model(), pairs(stream(), 16, 16, 48, torch.Generator().manual_seed(0))
    reference = copy.deepcopy(policy).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    margins = []
    for _ in range(15):
        out = dpo_step(policy, reference, opt, None, DPOConfig(), p)
        opt.zero_grad(set_to_none=True)
        margins.append(out["margin"])
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert margins[-1] > 0.5 and out["finite"]

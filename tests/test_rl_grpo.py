"""GRPO on the generated arithmetic task (lab/rl/task.py, lab/rl/grpo.py): the reward, the advantages, the two losses
written out by hand, and a short FP32 run over a pre-trained base that raises the reward."""
import copy

import pytest
import torch

from lab.rl import task
from lab.rl.grpo import GRPOConfig, advantages, answer_mask, grpo_step, token_loss
from lab.rl.grpo_run import pretrain_base, solved


def test_the_reward_reads_the_answer_up_to_the_first_end():
    pairs = torch.tensor([[37, 45], [10, 10], [99, 99], [12, 30]])
    generated = torch.tensor([task.encode(t) for t in ("82;;", "20;1", "198;", "4;2;")])
    assert task.reward(pairs, generated).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert task.reward(pairs[:1], torch.tensor([task.encode("8282")])).tolist() == [0.0]  # no end: no reward
    assert task.decode(task.lines(pairs[:1])[0]) == "37+45=82;;"
    assert task.decode(task.prompts(pairs[:1])[0]) == "37+45="
    assert answer_mask(torch.tensor([task.encode("4;2;"), task.encode("1234")])).tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 1]]


def test_advantages_are_normalised_within_each_group():
    a = advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4)
    assert a[:4].sum().abs() < 1e-6 and a[0] > 0 > a[1]
    assert torch.all(a[4:] == 0)  # a group that all solved: nothing to learn from it


def test_the_two_losses_by_hand():
    log_mu = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    log_pi = torch.log(torch.tensor([[0.5, 0.75, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0]])
    loss, ratio, _ = token_loss(log_pi, log_mu, adv, GRPOConfig(loss="grpo"))
    assert ratio.detach()[0].tolist() == pytest.approx([1.0, 1.5, 0.2])
    assert loss.detach()[0].tolist() == pytest.approx([-1.0, -1.2, -0.2])  # min(r A, clip(r, 0.8, 1.2) A)
    loss.sum().backward()
    assert log_pi.grad[0].tolist() == pytest.approx([-1.0, 0.0, -0.2])  # a clipped token has no gradient
    log_pi.grad = None
    loss, ratio, _ = token_loss(log_pi, log_mu, adv, GRPOConfig(loss="grpo-tis"))
    assert ratio.detach()[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert loss.detach()[0].tolist() == pytest.approx([-1.0, -1.5, -0.2])  # weights min(pi/mu, 2)
    loss.sum().backward()
    assert log_pi.grad[0].tolist() == pytest.approx([-1.0, -1.5, -0.2])
    log_pi2 = torch.log(torch.tensor([[0.5, 0.75, 0.1]]))
    capped, _, _ = token_loss(log_pi2 + torch.tensor([[0.0, 1.0, 0.0]]), log_mu, adv, GRPOConfig(loss="grpo-tis"))
    assert capped[0, 1].item() == pytest.approx(-2.0)  # 1.5 e > C = 2: cut at 2
    with pytest.raises(ValueError, match="loss must be grpo or grpo-tis"):
        GRPOConfig(loss="ppo")


@pytest.fixture(scope="module")
def base():
    return pretrain_base(400, 0)  # the RL study's base (lab/rl/grpo_run.py)


@pytest.mark.parametrize("loss,correction", [("grpo", None), ("grpo-tis", None), ("grpo", "sequence-mis")])
def test_grpo_raises_the_reward_of_a_base_that_solves_some(base, loss, correction):
    """The base solves 20-80% of the problems; 60 GRPO steps in FP32 raise it (a wrong sign would lower it). FP32 in
    both paths: a sequence's product of ratios stays within e^(+-1e-4 T) of 1, and sequence-mis (C = 3) keeps all."""
    before = solved(base)
    assert 0.2 <= before <= 0.8
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = GRPOConfig(loss=loss, correction=correction)
    g, gs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    for _ in range(60):
        out = grpo_step(model, opt, None, cfg, task.problems(cfg.prompts, g), gs)
        opt.zero_grad(set_to_none=True)
        assert out["mismatch"]["abs_max"] < 1e-4 and out["kept"] == 1.0  # FP32 in both paths
    assert solved(model) > before + 0.05

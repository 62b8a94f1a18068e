"""The amax-history policy (lab/scaling/policies/amax.py) against a reference written here from its definition in FP64, and the
engine's observation of the gradients' maximum (lab/scaling/engine.py grads_amax, needs_grad_amax)."""
import math
import random
from fractions import Fraction

import pytest
import torch

import lab.scaling
from lab.scaling.engine import grads_amax

F16 = torch.finfo(torch.float16)
# 65520: the least value an FP32 -> FP16 cast rounds to inf, computed exactly (max + half an ulp of its binade)
OVERFLOW = float(Fraction(F16.max) + Fraction(F16.eps) * Fraction(F16.max) / (2 - Fraction(F16.eps)) / 2)
FLUSH = float(Fraction(F16.smallest_normal) * Fraction(F16.eps) / 2)


def reference(events, history, margin, init, lo, hi):
    """The policy's definition, one step at a time: the scales used at each step (exact rational arithmetic)."""
    hist, scale, used = [], Fraction(init), []
    for found_inf, amax in events:
        used.append(float(scale))
        if found_inf:
            obs = Fraction(OVERFLOW) / (scale * 2**margin)
        elif amax == 0:
            obs = Fraction(FLUSH) / scale
        else:
            obs = Fraction(amax)
        hist = (hist + [obs])[-history:]
        target = Fraction(F16.max) / 2**margin / max(hist)
        if target >= hi:
            scale = Fraction(hi)
        else:
            k = math.floor(math.log2(target))
            while Fraction(2) ** (k + 1) <= target:  # exact power-of-two floor
                k += 1
            while Fraction(2) ** k > target:
                k -= 1
            scale = max(Fraction(lo), Fraction(2) ** k)
    return used


def drive(events, **params):
    policy = lab.scaling.create("amax-history", device="cpu", **params).policy
    scale, used = policy.init_scale, []
    for i, (found_inf, amax) in enumerate(events):
        used.append(scale)
        scale = policy.update(scale, found_inf, i, None, grad_amax=math.inf if found_inf else amax)
    return used


@pytest.mark.parametrize("history,margin", [(1, 0), (4, 1), (16, 3), (1024, 2)])
def test_policy_equals_its_definition_step_for_step(history, margin):
    rng = random.Random(history * 7 + margin)
    events = []
    for _ in range(400):  # drifting magnitudes over 40 binades, overflows, spikes and all-zero steps
        r = rng.random()
        events.append((True, None) if r < 0.05 else (False, 0.0) if r < 0.08 else
                      (False, 2.0 ** rng.uniform(-30, 10) * rng.choice([1, 1, 1, 1000])))
    params = dict(history=history, margin=margin, init_scale=1024.0, min_scale=2.0**-24, max_scale=2.0**24)
    want = reference(events, history, margin, 1024.0, 2.0**-24, 2.0**24)
    assert drive(events, **params) == want


def test_overflow_halves_at_once_and_the_spike_holds_for_the_history():
    h = 8
    events = [(False, 1.0)] * 5 + [(True, None)] + [(False, 1.0)] * 12
    used = drive(events, history=h, margin=0, init_scale=2.0**15)
    steady = used[1]  # 65504 / 1.0 -> 2^15
    assert steady == 2.0**15
    assert used[6] == steady / 2  # the step after the overflow
    assert used[6:6 + h] == [steady / 2] * h  # held down while the overflow's observation is in the history
    assert used[6 + h] == steady  # and back once it has left


def test_zero_gradients_raise_the_scale_and_scale_clamps():
    used = drive([(False, 0.0)] * 3, history=4, margin=0, init_scale=1.0, max_scale=2.0**20)
    assert used == [1.0, 2.0**20, 2.0**20]
    used = drive([(False, 1e9)] * 2, history=4, margin=0, init_scale=1.0, min_scale=2.0**-10)
    assert used == [1.0, 2.0**-10]  # 65504 / 1e9 is under the floor


def test_state_dict_resumes_the_same_trajectory():
    events = [(False, 2.0 ** -(i % 7)) for i in range(30)] + [(True, None)] + [(False, 0.5)] * 10
    full = drive(events, history=16)
    a = lab.scaling.create("amax-history", device="cpu")
    scale = a.policy.init_scale
    for i, (f, m) in enumerate(events[:20]):
        scale = a.policy.update(scale, f, i, None, grad_amax=m)
    b = lab.scaling.create("amax-history", device="cpu")
    b.policy.load_state_dict(a.policy.state_dict())
    rest = []
    for i, (f, m) in enumerate(events[20:], start=20):
        rest.append(scale)
        scale = b.policy.update(scale, f, i, None, grad_amax=math.inf if f else m)
    assert rest == full[20:]


@pytest.mark.parametrize("params", [dict(history=0), dict(margin=-1), dict(init_scale=2.0**30),
                                    dict(min_scale=0.0), dict(history=1.5)])
def test_bad_parameters_are_refused(params):
    with pytest.raises(ValueError, match="amax-history"):
        lab.scaling.create("amax-history", device="cpu", **params)


def test_grads_amax_is_the_largest_absolute_value():
    g = [torch.tensor([1.0, -3.5, 2.0]), torch.randn(5, 7), torch.tensor([[-7.25]]), torch.zeros(3)]
    want = max(float(t.double().abs().max()) for t in g)
    assert grads_amax(g).item() == want
    assert math.isnan(grads_amax([torch.tensor([1.0, float("nan")])]).item())


def test_engine_hands_the_policy_the_unscaled_maximum_in_one_sync(monkeypatch):
    """In a real training step: the policy receives max |grad| of the unscaled gradients (inf on an overflow)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lab.scaling.create("amax-history", device="cpu", init_scale=256.0)
    seen = []
    orig = scaler.policy.update

    def spy(scale, found_inf, step, grad_norm=None, grad_amax=None):
        seen.append(grad_amax)
        return orig(scale, found_inf, step, grad_norm, grad_amax=grad_amax)
    monkeypatch.setattr(scaler.policy, "update", spy)
    for step in range(3):
        x = torch.randn(4, 6)
        loss = model(x).pow(2).mean()
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        want = max(float(p.grad.double().abs().max()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert seen[-1] == (math.inf if step == 2 else pytest.approx(want, rel=0, abs=0))
        assert scaler.last_grad_amax == seen[-1]
    assert scaler.overflow_steps == 1 and scaler.skipped_steps == 1


def test_policies_that_do_not_ask_get_no_maximum():
    scaler = lab.scaling.create("dynamic", device="cpu")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_grad_amax is None

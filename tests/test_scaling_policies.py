"""lab.scaling policies against their rules (hand-derived sequences and reference transcriptions),
and the engine's two guards (alert, FP32 fallback)."""

import logging
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import lab.scaling as ls

torch.set_num_threads(1)


def f32(x):
    """Round to float32 (numpy), independent of the lab's helpers."""
    return float(np.float32(x))


class Driver:
    """A one-tensor 'model' whose unscaled gradient (and so its norm) the test chooses per step."""

    def __init__(self, scaler, n=4):
        self.p = nn.Parameter(torch.zeros(n))
        self.opt = torch.optim.SGD([self.p], lr=1.0)
        self.scaler = scaler
        self.n = n

    def step(self, outcome):
        """outcome: 'inf' / 'nan' / '-inf' or the wanted unscaled grad norm (float)."""
        s = self.scaler
        self.opt.zero_grad()
        norm = 1.0 if isinstance(outcome, str) else outcome
        c = torch.full((self.n,), norm / math.sqrt(self.n))
        s.scale((self.p * c).sum()).backward()
        if isinstance(outcome, str):
            self.p.grad[1] = float(outcome)
        before = self.p.detach().clone()
        s.step(self.opt)
        s.update()
        moved = not torch.equal(before, self.p.detach())
        return s.get_scale(), moved

    def run(self, outcomes):
        return [self.step(o) for o in outcomes]


def scales(results):
    return [r[0] for r in results]


# ----------------------------------------------------------------------------- none / static
def test_none_policy_counts_overflows_but_applies_the_step():
    d = Driver(ls.create("none", device="cpu"))
    res = d.run([0.5, "inf"])
    s = d.scaler
    assert s.last_found_inf and not s.last_step_skipped
    res += d.run([0.5])
    assert scales(res) == [1.0, 1.0, 1.0]
    assert res[1][1] is True  # the overflowing step was applied (plain FP16 behaviour)
    assert not torch.isfinite(d.p).all()
    assert s.overflow_steps == 1 and s.skipped_steps == 0 and s.consecutive_skips == 0


def test_none_policy_with_skip_on_overflow_skips():
    d = Driver(ls.create("none", skip_on_overflow=True, device="cpu"))
    res = d.run([0.5, "nan", "inf", 0.5])
    assert [moved for _, moved in res] == [True, False, False, True]
    assert scales(res) == [1.0] * 4
    assert d.scaler.skipped_steps == 2 and d.scaler.max_consecutive_skips == 2
    assert torch.isfinite(d.p).all()


def test_static_scale_never_changes_and_overflow_steps_are_skipped():
    d = Driver(ls.create("static", scale=1024.0, device="cpu"))
    res = d.run([1.0, "inf", 1e-6, "nan", "-inf", 1e3, 1.0])
    assert scales(res) == [1024.0] * 7
    assert [m for _, m in res] == [True, False, True, False, False, True, True]
    s = d.scaler
    assert (s.overflow_steps, s.skipped_steps, s.max_consecutive_skips, s.steps) == (3, 3, 2, 7)
    assert s.state_dict()["scale"] == 1024.0
    assert ls.create("static", device="cpu").get_scale() == 128.0


# ----------------------------------------------------------------------------- dynamic (rule level)
def test_dynamic_policy_matches_torch_update_kernel_on_random_sequences():
    rng = random.Random(0)
    for trial in range(20):
        g, b = rng.choice([2.0, 1.1, 1.7, 3.0]), rng.choice([0.5, 0.3, 0.77, 0.9])
        interval = rng.choice([1, 2, 3, 7])
        init = rng.choice([2.0**16, 1.0, 12345.678, 2.0**126])
        pol = ls.create("dynamic", device="cpu", init_scale=init, growth_factor=g, backoff_factor=b,
                        growth_interval=interval).policy
        t_scale = torch.tensor(init, dtype=torch.float32)
        t_track = torch.zeros((), dtype=torch.int32)
        s = t_scale.item()
        p_bad = rng.choice([0.02, 0.3, 0.9])
        for i in range(400):
            bad = rng.random() < p_bad
            torch._amp_update_scale_(t_scale, t_track, torch.tensor(float(bad)), g, b, interval)
            s = pol.update(s, bad, i)
            assert s == t_scale.item() or (math.isnan(s) and math.isnan(t_scale.item()))
            assert pol.state_dict()["_growth_tracker"] == t_track.item()


def test_dynamic_growth_to_fp32_infinity_is_refused():
    pol = ls.create("dynamic", device="cpu", growth_interval=2).policy
    big = 2.0**127
    assert pol.update(big, False, 0) == big and pol.state_dict()["_growth_tracker"] == 1
    assert pol.update(big, False, 1) == big  # 2**128 is inf in FP32: refused...
    assert pol.state_dict()["_growth_tracker"] == 0  # ...but the tracker still resets
    assert pol.update(2.0**126, False, 2) == 2.0**126
    assert pol.update(2.0**126, False, 3) == 2.0**127


def test_dynamic_has_no_lower_bound():
    pol = ls.create("dynamic", device="cpu", init_scale=1.0).policy
    s = 1.0
    for i in range(160):
        s = pol.update(s, True, i)
    assert s == 0.0  # halves through the subnormals down to zero, like GradScaler


# ----------------------------------------------------------------------------- hysteresis
def test_hysteresis_hand_derived_sequence():
    d = Driver(ls.create("hysteresis", init_scale=1024.0, growth_interval=2, hysteresis=2,
                         min_scale=256.0, device="cpu"))
    outcomes = ["inf", "inf", "inf", "inf", 1.0, 1.0, "inf", 1.0, "nan", 1.0, 1.0]
    expected = [
        1024.0,  # inf: hysteresis 2 -> 1, no backoff yet
        512.0,   # inf: hysteresis 0 -> backoff
        256.0,   # inf: -1 -> backoff
        256.0,   # inf: 128 clamped to min_scale
        256.0,   # clean: growth tracker 1
        512.0,   # clean: tracker 2 == interval -> grow, hysteresis refilled to 2
        512.0,   # inf: hysteresis 1, no backoff
        512.0,   # clean: tracker 1 (hysteresis NOT refilled by a clean step)
        256.0,   # nan: hysteresis 0 -> backoff, tracker 0
        256.0,   # clean: tracker 1
        512.0,   # clean: grow
    ]
    res = d.run(outcomes)
    assert scales(res) == expected
    assert [m for _, m in res] == [isinstance(o, float) for o in outcomes]  # every overflow skipped
    assert d.scaler.state_dict()["hysteresis_tracker"] == 2
    assert d.scaler.state_dict()["growth_tracker"] == 0


def test_hysteresis_non_power_of_two_factors_hand_derived():
    d = Driver(ls.create("hysteresis", init_scale=1000.0, growth_interval=1, hysteresis=1,
                         min_scale=600.0, growth_factor=1.5, backoff_factor=0.7, device="cpu"))
    # 1000*1.5 = 1500; 1500*f32(0.7) = 1049.99998.. -> 1050 in FP32; 1050*f32(0.7) -> 735;
    # 735*0.7 = 514.5 < 600 -> min_scale
    assert scales(d.run([1.0, "inf", "inf", "inf", "inf"])) == [1500.0, 1050.0, 735.0, 600.0, 600.0]


class MegatronDynamicGradScaler:
    """Transcription of Megatron-LM's DynamicGradScaler (float32 tensors, here on the CPU)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


@pytest.mark.parametrize("cfg", [
    dict(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2),
    dict(initial_scale=3.3e4, min_scale=7.77, growth_factor=1.3, backoff_factor=0.71, growth_interval=2, hysteresis=3),
    dict(initial_scale=1e3, min_scale=1e3, growth_factor=1.1, backoff_factor=0.9, growth_interval=1, hysteresis=1),
    dict(initial_scale=2.0**120, min_scale=1.0, growth_factor=3.0, backoff_factor=0.5, growth_interval=1, hysteresis=2),
])
def test_hysteresis_matches_megatron_transcription(cfg):
    rng = random.Random(str(cfg))
    ref = MegatronDynamicGradScaler(**cfg)
    pol = ls.create("hysteresis", device="cpu", init_scale=cfg["initial_scale"], min_scale=cfg["min_scale"],
                    growth_factor=cfg["growth_factor"], backoff_factor=cfg["backoff_factor"],
                    growth_interval=cfg["growth_interval"], hysteresis=cfg["hysteresis"]).policy
    s = f32(cfg["initial_scale"])
    for i in range(600):
        bad = rng.random() < 0.35
        ref.update(bad)
        s = pol.update(s, bad, i)
        assert s == ref._scale.item(), i
        assert pol.state_dict() == {"growth_tracker": ref._growth_tracker,
                                    "hysteresis_tracker": ref._hysteresis_tracker}


def test_hysteresis_defaults_are_megatrons():
    s = ls.create("hysteresis", device="cpu")
    pol = s.policy
    assert s.get_scale() == 2.0**32
    assert (pol.growth_interval, pol.hysteresis, pol.min_scale, pol.growth_factor, pol.backoff_factor) == \
        (1000, 2, 1.0, 2.0, 0.5)


# ----------------------------------------------------------------------------- gradnorm
def test_gradnorm_rule_hand_derived():
    d = Driver(ls.create("gradnorm", init_scale=64.0, warmup_steps=3, high=10.0, low=0.1, max_scale=100.0,
                         device="cpu"))
    outcomes = [1e3, "inf", 1e-3,  # warm-up: only the inf step changes the scale (halves)
                1e3,                # norm > high -> halve
                1.0]                # between low and high -> unchanged
    expected = [64.0, 32.0, 32.0, 16.0, 16.0]
    s = 16.0
    while True:  # norm < low -> *1.2 (rounded to FP32 like the update kernel), capped at max_scale
        outcomes.append(1e-3)
        s = min(f32(s * 1.2), 100.0)
        expected.append(s)
        if s == 100.0:
            break
    outcomes += [1e-3, 1e-3, "nan", 1e4, 1e-2]
    expected += [100.0, 100.0, 50.0, 25.0, f32(25.0 * 1.2)]
    res = d.run(outcomes)
    assert scales(res) == expected
    assert expected.count(100.0) == 3 and len(expected) > 15  # the cap was reached and held
    assert [m for _, m in res] == [o not in ("inf", "nan") for o in outcomes]  # only inf/nan skipped
    assert d.scaler.last_grad_norm == pytest.approx(1e-2, rel=1e-4)


def test_gradnorm_defaults():
    pol = ls.create("gradnorm", device="cpu").policy
    assert (pol.warmup_steps, pol.high, pol.low, pol.max_scale, pol.growth_factor) == (10, 1e3, 1e-3, 1e5, 1.2)
    assert pol.needs_grad_norm and pol.skip_on_overflow
    # growth just below the cap lands exactly on the cap; at the cap it stays
    assert pol.update(9e4, False, 10, 1e-6) == 1e5
    assert pol.update(1e5, False, 11, 1e-6) == 1e5
    assert pol.update(1e5, False, 9, 1e6) == 1e5  # still warming up (index 9 < 10)
    assert pol.update(1e5, False, 10, 1e6) == 5e4


# ----------------------------------------------------------------------------- warmup
def test_warmup_rule_hand_derived():
    d = Driver(ls.create("warmup", init_scale=4096.0, warmup_steps=5, growth_interval=3, max_scale=16384.0,
                         device="cpu"))
    outcomes = [1.0] * 5 + [1.0] * 3 + ["inf"] + [1.0] * 3 + [1.0] * 3 + [1.0] * 3 + ["nan"]
    expected = ([4096.0] * 5            # warm-up: no growth although 5 >= 3 clean steps
                + [4096.0, 4096.0, 8192.0]   # 3 clean steps after warm-up -> grow
                + [4096.0]                   # overflow -> backoff, tracker reset
                + [4096.0, 4096.0, 8192.0]
                + [8192.0, 8192.0, 16384.0]
                + [16384.0] * 3              # capped at max_scale
                + [8192.0])
    assert scales(d.run(outcomes)) == expected
    assert d.scaler.skipped_steps == 2


def test_warmup_defaults_and_backoff_during_warmup():
    s = ls.create("warmup", device="cpu")
    pol = s.policy
    assert (s.get_scale(), pol.warmup_steps, pol.growth_interval, pol.max_scale) == (4096.0, 50, 100, 65536.0)
    d = Driver(s)
    assert scales(d.run(["inf", 1.0, "inf"])) == [2048.0, 2048.0, 1024.0]
    # first growth on the 100th clean update after the 50 warm-up updates (0-based index 149)
    sc = 1024.0
    for i in range(3, 149):
        sc = pol.update(sc, False, i)
    assert sc == 1024.0
    assert pol.update(sc, False, 149) == 2048.0


def test_warmup_cap_that_is_not_a_power_of_two():
    pol = ls.create("warmup", device="cpu", init_scale=1000.0, warmup_steps=0, growth_interval=1,
                    max_scale=3000.0).policy
    s = 1000.0
    seq = []
    for i in range(4):
        s = pol.update(s, False, i)
        seq.append(s)
    assert seq == [2000.0, 3000.0, 3000.0, 3000.0]


# ----------------------------------------------------------------------------- guards
def test_alert_guard_logs_and_counts_once_per_run(caplog):
    d = Driver(ls.create("static", scale=128.0, alert_after=3, device="cpu"))
    outcomes = ["inf"] * 2 + [1.0] + ["inf"] * 4 + [1.0] + ["nan"] * 3
    with caplog.at_level(logging.WARNING, logger="lab.scaling"):
        d.run(outcomes)
    s = d.scaler
    assert s.alerts == 2
    warnings_ = [r for r in caplog.records if r.name == "lab.scaling" and r.levelno == logging.WARNING]
    assert len(warnings_) == 2 and "3 consecutive skipped steps" in warnings_[0].getMessage()
    assert s.consecutive_skips == 3 and s.max_consecutive_skips == 4 and s.skipped_steps == 9
    assert not s.fp32_fallback and s.fallback_step is None


def test_alert_guard_can_be_disabled(caplog):
    d = Driver(ls.create("static", alert_after=None, device="cpu"))
    with caplog.at_level(logging.WARNING, logger="lab.scaling"):
        d.run(["inf"] * 6)
    assert d.scaler.alerts == 0 and not caplog.records


def test_fp32_fallback_guard_freezes_the_policy_at_scale_one(caplog):
    s = ls.create("dynamic", init_scale=1024.0, growth_interval=1, fp32_fallback_after=3, alert_after=2,
                  device="cpu")
    d = Driver(s)
    with caplog.at_level(logging.WARNING, logger="lab.scaling"):
        res = d.run([1.0, 1.0, "inf", "inf", "inf", 1.0, 1.0, "nan", 1.0])
    assert scales(res)[:4] == [2048.0, 4096.0, 2048.0, 1024.0]
    assert scales(res)[4:] == [1.0] * 5  # fallback at the third consecutive skip; no more growth
    assert s.fp32_fallback and s.fallback_step == 4
    assert [m for _, m in res][5:] == [True, True, False, True]  # non-finite steps still skipped
    assert s._scale.item() == 1.0 and torch.equal(s.scale(torch.tensor(3.0)), torch.tensor(3.0))
    assert s.alerts == 1 and any("FP32" in r.getMessage() for r in caplog.records)
    sd = s.state_dict()
    assert sd["fp32_fallback"] is True and sd["fallback_step"] == 4 and sd["scale"] == 1.0
    assert s.max_consecutive_skips == 3 and s.consecutive_skips == 0


def test_fp32_fallback_is_off_by_default():
    d = Driver(ls.create("static", device="cpu"))
    d.run(["inf"] * 30)
    assert not d.scaler.fp32_fallback and d.scaler.get_scale() == 128.0 and d.scaler.alerts == 1


def test_gradnorm_policy_is_not_consulted_after_fallback():
    s = ls.create("gradnorm", init_scale=64.0, warmup_steps=0, fp32_fallback_after=2, device="cpu")
    d = Driver(s)
    res = d.run(["inf", "inf", 1e-6, 1e6])
    assert scales(res) == [32.0, 1.0, 1.0, 1.0]
    assert s.fallback_step == 1


def test_smooth_capped_grows_by_quarter_octaves_at_gradscalers_pace_and_never_past_its_cap():
    """lab/scaling/policies/smooth_capped.py: 2^(1/4) every 500 clean steps (a doubling per 2000, as GradScaler), halving on
    overflow, never above 2^16."""
    import lab.scaling
    policy = lab.scaling.create("smooth-capped", device="cpu").policy
    scale, seen = 2.0 ** 16, []
    for step in range(5000):
        scale = policy.update(scale, step in (0, 1), step)
        seen.append(scale)
    assert seen[0] == 2.0 ** 15 and seen[1] == 2.0 ** 14  # halved on each overflow
    assert seen[500] == seen[2] == 2.0 ** 14 and seen[501] == pytest.approx(2.0 ** 14.25, rel=1e-6)
    assert seen[2001] == pytest.approx(2.0 ** 15, rel=1e-6)  # 2000 clean steps: one doubling, as GradScaler
    assert max(seen) == 2.0 ** 16 and seen[-1] == 2.0 ** 16  # back at the cap, and no higher

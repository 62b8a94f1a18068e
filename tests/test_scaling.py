"""lab.scaling: registry/create API, and the `dynamic` policy against torch.amp.GradScaler.

The parity tests drive the lab scaler and ``torch.amp.GradScaler("cpu")`` side by side on two
identical copies of a small model, with inf/nan injected into the scaled gradients at random
steps, and require identical scales, skip decisions, growth trackers and parameters after every
update.
"""

import copy
import math
import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import lab.scaling as ls
from conftest import CountingSGD
from lab.scaling import base as ls_base

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- helpers
def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def params_equal(m1, m2):
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def batch(gen, n=8):
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


# ----------------------------------------------------------------------------- registry / create
def test_available_is_sorted_and_lists_shipped_policies():
    names = ls.available()
    assert names == sorted(names)
    assert {"none", "static", "dynamic", "hysteresis", "gradnorm", "warmup"} <= set(names)


def test_unknown_policy_name_lists_available():
    with pytest.raises(ValueError) as ei:
        ls.create("dynamix")
    msg = str(ei.value)
    assert "dynamix" in msg
    for name in ls.available():
        assert name in msg


def test_unknown_parameter_lists_policy_and_engine_params():
    with pytest.raises(ValueError) as ei:
        ls.create("dynamic", growth_intervall=10)
    msg = str(ei.value)
    assert "growth_intervall" in msg
    for p in ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
              "enabled", "device", "alert_after", "fp32_fallback_after"):
        assert p in msg
    # a parameter of another policy is unknown here too
    with pytest.raises(ValueError, match="hysteresis"):
        ls.create("dynamic", hysteresis=2)
    assert ls.accepted_params("static")["policy"] == ["scale"]


@pytest.mark.parametrize("name,params", [
    ("static", {"scale": 0}),
    ("static", {"scale": -4.0}),
    ("static", {"scale": math.inf}),
    ("static", {"scale": math.nan}),
    ("static", {"scale": "128"}),
    ("dynamic", {"growth_factor": 1.0}),
    ("dynamic", {"backoff_factor": 1.0}),
    ("dynamic", {"backoff_factor": 0.0}),
    ("dynamic", {"growth_interval": 0}),
    ("dynamic", {"growth_interval": 2.5}),
    ("dynamic", {"init_scale": -1.0}),
    ("hysteresis", {"hysteresis": 0}),
    ("hysteresis", {"min_scale": 0.0}),
    ("hysteresis", {"init_scale": 2.0, "min_scale": 4.0}),
    ("hysteresis", {"backoff_factor": 1.5}),
    ("gradnorm", {"low": 10.0, "high": 1.0}),
    ("gradnorm", {"init_scale": 2.0**20}),  # above max_scale 1e5
    ("gradnorm", {"warmup_steps": -1}),
    ("warmup", {"max_scale": 1024.0}),  # below init_scale 4096
    ("warmup", {"growth_factor": 0.9}),
    ("none", {"skip_on_overflow": 1}),
    ("dynamic", {"alert_after": 0}),
    ("dynamic", {"fp32_fallback_after": -3}),
    ("dynamic", {"enabled": "yes"}),
])
def test_bad_parameter_values_raise_value_error(name, params):
    with pytest.raises(ValueError):
        ls.create(name, **params)


@pytest.mark.parametrize("kw", [{"growth_factor": 0.9}, {"backoff_factor": 1.5}])
def test_dynamic_validation_errors_match_gradscaler(kw):
    with pytest.raises(AssertionError) as ref:
        torch.amp.GradScaler("cpu", **kw)
    with pytest.raises(AssertionError) as ours:  # also a ValueError
        ls.create("dynamic", device="cpu", **kw)
    assert isinstance(ours.value, ValueError)
    assert str(ours.value) == str(ref.value)


@pytest.fixture
def scratch_registry():
    saved = dict(ls_base._REGISTRY)
    yield
    ls_base._REGISTRY.clear()
    ls_base._REGISTRY.update(saved)


def test_user_policy_in_one_small_class(scratch_registry):
    @ls.register("halving_test")
    class Halving(ls.ScalingPolicy):
        def __init__(self, init_scale: float = 1024.0):
            self.init_scale = self.check_positive("init_scale", init_scale)

        def update(self, scale, found_inf, step, grad_norm=None):
            return scale * 0.5 if found_inf else scale

    assert "halving_test" in ls.available()
    s = ls.create("halving_test", init_scale=512.0, device="cpu")
    assert s.get_scale() == 512.0 and s.policy.name == "halving_test"
    p = nn.Parameter(torch.ones(3))
    opt = CountingSGD([p], lr=0.1)
    for bad in (False, True, True, False):
        s.scale((p * 2).sum()).backward()
        if bad:
            p.grad[0] = math.inf
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert s.get_scale() == 128.0 and opt.calls == 2 and s.skipped_steps == 2
    with pytest.raises(ValueError, match="init_scale"):
        ls.create("halving_test", init_scale=-1)
    with pytest.raises(ValueError, match="init_scale"):
        ls.create("halving_test", scale=3)

    # a second class under a taken name is refused; non-policies are refused
    with pytest.raises(ValueError, match="already registered"):
        @ls.register("halving_test")
        class Other(ls.ScalingPolicy):
            def update(self, scale, found_inf, step, grad_norm=None):
                return scale
    with pytest.raises(TypeError):
        ls.register("not_a_policy")(object)


def test_missing_required_user_parameter_is_value_error(scratch_registry):
    @ls.register("needs_arg_test")
    class NeedsArg(ls.ScalingPolicy):
        def __init__(self, scale):
            self.init_scale = self.check_positive("scale", scale)

        def update(self, scale, found_inf, step, grad_norm=None):
            return scale

    with pytest.raises(ValueError, match="scale"):
        ls.create("needs_arg_test")
    assert ls.create("needs_arg_test", scale=8.0, device="cpu").get_scale() == 8.0


# ----------------------------------------------------------------------------- FP32 helpers
def test_kernel_mul_rounds_like_torch_update_kernel():
    rng = random.Random(1)
    for _ in range(300):
        s = float(np.float32(rng.uniform(1e-3, 1e30)))
        g, b = rng.uniform(1.0001, 5.0), rng.uniform(0.01, 0.999)
        for found, factor in ((0.0, g), (1.0, b)):
            t = torch.tensor(s, dtype=torch.float32)
            torch._amp_update_scale_(t, torch.zeros((), dtype=torch.int32), torch.tensor(found), g, b, 1)
            assert ls.kernel_mul(s, factor) == t.item()
    assert ls.to_f32(3.4e38 * 4) == math.inf and ls.to_f32(1e-50) == 0.0


# ----------------------------------------------------------------------------- parity with GradScaler
def run_side_by_side(steps, seed, clip_every=0, new_scale_at=None, p_bad=0.25, **cfg):
    """Drive lab 'dynamic' and torch GradScaler on identical models; check after every update."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m_lab = tiny_model(seed)
    m_ref = copy.deepcopy(m_lab)
    o_lab = CountingSGD(m_lab.parameters(), lr=0.05, momentum=0.9)
    o_ref = CountingSGD(m_ref.parameters(), lr=0.05, momentum=0.9)
    s_lab = ls.create("dynamic", device="cpu", **cfg)
    s_ref = torch.amp.GradScaler("cpu", **cfg)
    n_params = len(list(m_lab.parameters()))
    injected = skipped = grew_to_limit = grew = 0
    for i in range(steps):
        x, y = batch(gen)
        inject = None
        if rng.random() < p_bad:
            inject = (rng.randrange(n_params), rng.randrange(6), rng.choice([math.inf, -math.inf, math.nan]))
        clip = clip_every and i % clip_every == 0
        calls_before = (o_lab.calls, o_ref.calls)
        scale_before = s_lab.get_scale()
        for model, opt, scaler in ((m_lab, o_lab, s_lab), (m_ref, o_ref, s_ref)):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if inject is not None:
                k, j, val = inject
                list(model.parameters())[k].grad.view(-1)[j % list(model.parameters())[k].numel()] = val
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            if new_scale_at is not None and i == new_scale_at[0]:
                scaler.update(new_scale_at[1])
            else:
                scaler.update()
        stepped_lab = o_lab.calls - calls_before[0]
        stepped_ref = o_ref.calls - calls_before[1]
        assert stepped_lab == stepped_ref, f"skip decision differs at step {i}"
        assert s_lab.last_step_skipped == (stepped_lab == 0) == s_lab.last_found_inf
        assert s_lab.get_scale() == s_ref.get_scale(), f"scale differs at step {i}"
        assert s_lab.state_dict()["_growth_tracker"] == s_ref._get_growth_tracker()
        assert s_lab._scale.dtype == torch.float32 and s_lab._scale.item() == s_ref._scale.item()
        assert params_equal(m_lab, m_ref), f"parameters differ at step {i}"
        injected += inject is not None
        skipped += stepped_lab == 0
        grew_to_limit += s_lab.get_scale() > 2.0**126
        grew += s_lab.get_scale() > scale_before
    sd_lab, sd_ref = s_lab.state_dict(), s_ref.state_dict()
    assert {k: sd_lab[k] for k in sd_ref} == sd_ref
    assert s_lab.steps == steps and s_lab.skipped_steps == skipped == s_lab.overflow_steps
    assert skipped >= injected  # natural FP32 overflows may add to the injected ones
    return s_lab, grew_to_limit, grew


@pytest.mark.parametrize("growth_interval,growth_factor,backoff_factor,init_scale,p_bad", [
    (1, 2.0, 0.5, 2.0**16, 0.25),
    (3, 1.7, 0.3, 2.0**16, 0.25),
    (7, 2.0, 0.5, 1000.0, 0.1),
    (50, 1.3, 0.77, 3.3e4, 0.01),
    (1, 1.1, 0.9, 12345.678, 0.4),
])
def test_dynamic_matches_gradscaler(growth_interval, growth_factor, backoff_factor, init_scale, p_bad):
    s, _, grew = run_side_by_side(300, seed=growth_interval, p_bad=p_bad, growth_interval=growth_interval,
                                  growth_factor=growth_factor, backoff_factor=backoff_factor,
                                  init_scale=init_scale)
    assert grew >= 2 and s.skipped_steps >= 2  # both branches of the rule were exercised


def test_dynamic_matches_gradscaler_at_fp32_limit():
    # growth_interval=1 from a huge scale: the scale runs into FP32's range, growth to inf must be
    # refused and scaled-loss overflows happen naturally; everything still matches GradScaler.
    s, at_limit, _ = run_side_by_side(200, seed=11, growth_interval=1, init_scale=2.0**120)
    assert at_limit > 0
    assert math.isfinite(s.get_scale())


def test_dynamic_matches_gradscaler_with_clipping_and_manual_new_scale():
    run_side_by_side(200, seed=5, clip_every=2, new_scale_at=(77, 1234.5),
                     growth_interval=4, growth_factor=1.5, backoff_factor=0.6)


def test_dynamic_matches_gradscaler_with_fused_adam():
    class CountingAdam(torch.optim.Adam):
        def __init__(self, params, lr, momentum):
            super().__init__(params, lr=lr * 0.1, fused=True)
            self.calls = 0

        def step(self, closure=None):
            self.calls += 1
            return super().step(closure)

    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    m_lab = tiny_model(3)
    m_ref = copy.deepcopy(m_lab)
    o_lab, o_ref = CountingAdam(m_lab.parameters(), 0.05, 0), CountingAdam(m_ref.parameters(), 0.05, 0)
    s_lab = ls.create("dynamic", device="cpu", growth_interval=2)
    s_ref = torch.amp.GradScaler("cpu", growth_interval=2)
    skipped = 0
    for i in range(60):
        x, y = batch(gen)
        bad = rng.random() < 0.3
        for model, opt, scaler in ((m_lab, o_lab, s_lab), (m_ref, o_ref, s_ref)):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if bad:
                model[0].weight.grad[0, 0] = math.nan
            scaler.step(opt)
            scaler.update()
        skipped += bad
        assert s_lab.get_scale() == s_ref.get_scale()
        assert s_lab.last_step_skipped == bad
        assert params_equal(m_lab, m_ref)
    assert s_lab.skipped_steps == skipped > 0


def test_gradscaler_state_dict_round_trip_between_lab_and_torch():
    gen = torch.Generator().manual_seed(0)
    model = tiny_model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    ref = torch.amp.GradScaler("cpu", growth_interval=5, growth_factor=1.25, backoff_factor=0.4)
    for i in range(13):
        opt.zero_grad()
        x, y = batch(gen)
        ref.scale(nn.functional.mse_loss(model(x), y)).backward()
        if i == 4:
            model[0].bias.grad[0] = math.inf
        ref.step(opt)
        ref.update()
    lab = ls.create("dynamic", device="cpu")  # default config is replaced by the loaded one
    lab.load_state_dict(ref.state_dict())
    assert lab.get_scale() == ref.get_scale()
    assert {k: lab.state_dict()[k] for k in ref.state_dict()} == ref.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(lab.state_dict())
    assert back.state_dict() == ref.state_dict()


# ----------------------------------------------------------------------------- state_dict resume
POLICY_CONFIGS = {
    "none": {},
    "static": {"scale": 1024.0},
    "dynamic": {"growth_interval": 3, "growth_factor": 1.7, "backoff_factor": 0.3},
    "hysteresis": {"init_scale": 2.0**16, "growth_interval": 3, "hysteresis": 2, "min_scale": 64.0,
                   "growth_factor": 1.5},
    "gradnorm": {"warmup_steps": 5, "high": 0.5, "low": 0.05},
    "warmup": {"warmup_steps": 10, "growth_interval": 4},
}


def _run_segment(model, opt, scaler, gen, schedule, record):
    for bad in schedule:
        opt.zero_grad(set_to_none=True)
        x, y = batch(gen)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if bad:
            model[2].weight.grad[0, 0] = math.inf if bad == 1 else math.nan
        scaler.step(opt)
        scaler.update()
        record.append((scaler.get_scale(), scaler.last_step_skipped,
                       [p.detach().clone() for p in model.parameters()]))


@pytest.mark.parametrize("name", sorted(POLICY_CONFIGS))
def test_state_dict_resume_continues_same_trajectory(name):
    rng = random.Random(name)
    schedule = [rng.choice([0, 0, 0, 0, 1, 2]) for _ in range(120)]
    schedule[39:45] = [0, 1, 1, 1, 1, 0]  # a run of 4 skips right before the cut
    # static also runs the FP32-fallback guard (it fires at the latest in that run)
    cfg = dict(POLICY_CONFIGS[name], device="cpu", fp32_fallback_after=4 if name == "static" else None)
    cut = 44

    model = tiny_model(1)
    opt = CountingSGD(model.parameters(), lr=0.02, momentum=0.9)
    scaler = ls.create(name, **cfg)
    gen = torch.Generator().manual_seed(7)
    first, full = [], []
    _run_segment(model, opt, scaler, gen, schedule[:cut], first)
    saved_scaler = copy.deepcopy(scaler.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_gen = gen.get_state()
    _run_segment(model, opt, scaler, gen, schedule[cut:], full)

    model2 = tiny_model(99)
    model2.load_state_dict(saved_model)
    opt2 = CountingSGD(model2.parameters(), lr=0.02, momentum=0.9)
    opt2.load_state_dict(saved_opt)
    scaler2 = ls.create(name, **cfg)
    scaler2.load_state_dict(saved_scaler)
    assert scaler2.get_scale() == saved_scaler["scale"]
    gen2 = torch.Generator()
    gen2.set_state(saved_gen)
    resumed = []
    _run_segment(model2, opt2, scaler2, gen2, schedule[cut:], resumed)

    assert len(resumed) == len(full)
    for (sa, ka, pa), (sb, kb, pb) in zip(full, resumed):
        assert sa == sb and ka == kb
        for a, b in zip(pa, pb):  # bitwise equal; NaN == NaN (policy 'none' applies NaN steps)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler.state_dict()["steps"] == len(schedule)
    if name != "none":
        assert saved_scaler["consecutive_skips"] == 4 and scaler.max_consecutive_skips >= 4
    else:
        assert saved_scaler["skipped_steps"] == 0 and saved_scaler["overflow_steps"] >= 4
    if name == "static":
        assert saved_scaler["fp32_fallback"] and scaler2.fp32_fallback and scaler2.get_scale() == 1.0
    # the scale actually moved for the adaptive policies (so the test can tell trajectories apart)
    if name in ("dynamic", "hysteresis", "gradnorm", "warmup"):
        assert len({r[0] for r in first + full}) > 2


def test_state_dict_of_other_policy_is_refused():
    a = ls.create("static", device="cpu")
    b = ls.create("dynamic", device="cpu")
    with pytest.raises(ValueError, match="static"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="hysteresis_tracker|growth_tracker"):
        ls.create("hysteresis", device="cpu").load_state_dict({"scale": 2.0})


def test_pickle_between_iterations_keeps_state():
    model = tiny_model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    s = ls.create("hysteresis", init_scale=1024.0, growth_interval=2, device="cpu")
    for _ in range(3):
        opt.zero_grad()
        s.scale(model(torch.ones(1, 6)).sum()).backward()
        s.step(opt)
        s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_scale() == s.get_scale() == 2048.0
    assert s2.state_dict() == s.state_dict()
    opt.zero_grad()
    s.scale(model(torch.ones(1, 6)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(AssertionError):
        pickle.dumps(s)  # mid-iteration

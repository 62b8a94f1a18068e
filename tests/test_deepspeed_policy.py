"""lab.scaling's `deepspeed` and `deepspeed-fp16` policies against the real DeepSpeed code (requirements.txt's
deepspeed==0.19.8), driven side by side step for step.

* `deepspeed`: DeepSpeed's ``DynamicLossScaler``, built as ZeRO stages 1-3 build it: ``CreateLossScaler``
  (deepspeed/runtime/fp16/loss_scaler.py:293, called at zero/stage_1_and_2.py:722 and zero/stage3.py:524) with
  the arguments the engine passes, ``DeepSpeedFP16Config(...).dynamic_loss_scale_args()``
  (runtime/precision_config.py:202, via engine.py ``dynamic_loss_scale_args``). ZeRO's ``step()`` calls
  ``update_scale(overflow)`` and returns before the optimiser step on every overflow
  (zero/stage_1_and_2.py:3046-3067), so DeepSpeed's skip decision there is the overflow flag.
* `deepspeed-fp16`: the real ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` (the non-ZeRO FP16 optimisers) on
  the CPU, built with the ``LossScaleConfig`` that engine.py ``_configure_fp16_optimizer`` builds, stepped with
  their own ``backward``/``step``; their skip decision is whether the wrapped optimiser's ``step`` ran.

The lab side is the whole engine (``lab.scaling.create(...)``: scale, fused unscale + inf/nan check, skip,
policy, FP32 rounding of the scale) on a one-tensor model whose gradient gets an inf planted on the overflow
steps. Compared at every step: the scale after the update, the skip decision, the policy's state against
DeepSpeed's own counters, and the floor error (both raise, at the same step).

``dist.get_rank``: DeepSpeed's scaler and FP16_UnfusedOptimizer call ``deepspeed.comm.get_rank()`` only to decide
whether to log (loss_scaler.py:262, 269, 278; unfused_optimizer.py:48), and it asserts when no DeepSpeed process
group exists. The fixture below monkeypatches ``deepspeed.comm.get_rank`` to return 0 instead of starting a
one-process gloo group: that would leave process-wide state (torch.distributed's default group, DeepSpeed's
``cdb``) in the pytest process the whole suite shares, where lab/run/distributed.py and tests/test_distributed.py
decide by ``dist.is_initialized()``, and it would need a free TCP port on a machine that runs CI in parallel.
Nothing but log lines depends on the rank.
"""

import inspect
import math
import random
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

deepspeed = pytest.importorskip("deepspeed")

import deepspeed.comm  # noqa: E402
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import (CreateLossScaler, DynamicLossScaler, LossScaleConfig,  # noqa: E402
                                                LossScaleProfile)
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402

import lab.scaling as ls  # noqa: E402
from conftest import CountingSGD  # noqa: E402
from lab.scaling.policies.deepspeed import DEEPSPEED_FLOOR_MESSAGE, ScaleFloorReached  # noqa: E402

torch.set_num_threads(1)

RAISE = "raise"  # a trace entry: the update raised DeepSpeed's floor error (the step was skipped)


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    """deepspeed.comm.get_rank() -> 0 without a process group (see the module docstring); records the calls."""
    calls = []

    def get_rank(group=None):
        calls.append(group)
        return 0

    monkeypatch.setattr(deepspeed.comm, "get_rank", get_rank)
    return calls


def f32(x):
    return float(np.float32(x))


# ----------------------------------------------------------------------------- the two sides
def lab_params(cfg):
    """DeepSpeed fp16 config keys -> the lab policy's parameters."""
    names = {"loss_scale_window": "scale_window", "hysteresis": "hysteresis",
             "consecutive_hysteresis": "consecutive_hysteresis", "min_loss_scale": "min_scale"}
    out = {names[k]: v for k, v in cfg.items() if k != "initial_scale_power"}
    if "initial_scale_power" in cfg:
        out["init_scale"] = 2.0 ** cfg["initial_scale_power"]
    return out


class Lab:
    """The lab engine with a policy on a 4-element FP32 parameter: loss = sum(p), so the scaled gradient is the
    scale itself and unscales to exactly 1."""

    def __init__(self, name, **params):
        self.scaler = ls.create(name, device="cpu", alert_after=None, **params)
        self.p = nn.Parameter(torch.zeros(4))
        self.opt = CountingSGD([self.p], lr=1e-3)

    def step(self, overflow):
        self.opt.zero_grad()
        self.scaler.scale(self.p.sum()).backward()
        if overflow:
            self.p.grad[1] = math.inf
        before = self.opt.calls
        self.scaler.step(self.opt)
        skipped = self.opt.calls == before
        try:
            self.scaler.update()
        except ScaleFloorReached as e:
            assert DEEPSPEED_FLOOR_MESSAGE in str(e)
            assert e.scale == e.min_scale == self.scaler.get_scale()
            assert e.step == self.scaler.steps - 1  # the raising update is counted (an overflow, skipped)
            return (RAISE, skipped)
        return (self.scaler.get_scale(), skipped)

    @property
    def state(self):
        return self.scaler.policy.state_dict()


class Zero:
    """DeepSpeed's DynamicLossScaler as ZeRO 1-3 build it from an fp16 config (or directly, for arguments the
    config cannot express)."""

    def __init__(self, direct=None, **cfg):
        if direct is None:
            args = DeepSpeedFP16Config(enabled=True, **cfg).dynamic_loss_scale_args()
            self.s = CreateLossScaler(dtype=torch.half, static_loss_scale=0, dynamic_scaling=True,
                                      dynamic_loss_args=args)
        else:
            self.s = DynamicLossScaler(dtype=torch.half, **direct)
        assert type(self.s) is DynamicLossScaler

    def step(self, overflow):
        try:
            self.s.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception (loss_scaler.py:258)
            assert str(e) == DEEPSPEED_FLOOR_MESSAGE
            return (RAISE, True)
        return (float(self.s.cur_scale), overflow)

    @property
    def scale(self):
        return float(self.s.cur_scale)

    @property
    def state(self):
        return {"cur_iter": self.s.cur_iter, "last_overflow_iter": self.s.last_overflow_iter,
                "cur_hysteresis": self.s.cur_hysteresis}


def fp16_loss_scale_config(cls, cfg):
    """The LossScaleConfig engine.py _configure_fp16_optimizer builds for ``cls`` from an fp16 config."""
    c = DeepSpeedFP16Config(enabled=True, **cfg)
    profile = LossScaleProfile.FUSED if cls is FP16_Optimizer else LossScaleProfile.UNFUSED
    return LossScaleConfig(low_precision_dtype=torch.float16, dynamic_loss_scale=c.loss_scale == 0,
                           static_loss_scale=c.loss_scale, dynamic_loss_args=c.dynamic_loss_scale_args(),
                           profile=profile,
                           initial_dynamic_scale=c.initial_dynamic_scale() if profile is LossScaleProfile.FUSED
                           else None)


class FP16:
    """A real FP16_Optimizer / FP16_UnfusedOptimizer on a 4-element FP16 parameter (CPU accelerator).

    loss = sum(p) * 2**-100 keeps the FP16 gradient (2**-100 * scale) finite for scales up to 2**115: only the
    planted inf overflows."""

    def __init__(self, cls, **cfg):
        self.p = nn.Parameter(torch.zeros(4, dtype=torch.half))
        self.inner = CountingSGD([self.p], lr=1e-3)
        self.lsc = fp16_loss_scale_config(cls, cfg)
        self.opt = cls(self.inner, loss_scale_config=self.lsc, low_precision_dtype=torch.float16)

    def step(self, overflow):
        self.opt.zero_grad()
        self.opt.backward(self.p.float().sum() * 2.0**-100)
        if overflow:
            self.p.grad[1] = math.inf
        before = self.inner.calls
        self.opt.step()
        assert self.opt.overflow == overflow
        return (float(self.opt.loss_scale), self.inner.calls == before)

    @property
    def scale(self):
        return float(self.opt.loss_scale)

    @property
    def state(self):
        return {"cur_iter": self.lsc.cur_iter, "last_overflow_iter": self.lsc.last_overflow_iter}


def side_by_side(lab, ref, outcomes, expect=None):
    """Step both with the same overflow flags until one raises; assert the same (scale, skipped) and the same
    counters after every step. ``outcomes``: a list of flags, or an :class:`Edge` that picks each flag from
    DeepSpeed's current scale. ``expect(ref_entry)`` maps DeepSpeed's entry to the lab's expected one (default:
    identical). Returns DeepSpeed's trace."""
    trace = []
    scale = ref.scale
    for i in range(len(outcomes)):
        overflow = outcomes[i] if isinstance(outcomes, list) else outcomes(scale)
        got, want = lab.step(overflow), ref.step(overflow)
        exp = want if expect is None else expect(want)
        assert got == exp, f"step {i} (overflow={overflow}): lab {got}, DeepSpeed {want}; trace tail {trace[-5:]}"
        trace.append(want)
        assert lab.state == ref.state, f"step {i}"  # after a raise too: neither changed anything
        if want[0] == RAISE:
            break
        scale = want[0]
    return trace


def scales(trace):
    return [s for s, _ in trace]


def growth_steps(trace, init):
    out, prev = [], init
    for i, (s, _) in enumerate(trace):
        if s != RAISE and s > prev:
            out.append(i)
        prev = s
    return out


class Edge:
    """Overflow flags as training makes them, so that the scale rides an edge instead of drifting to a bound:
    a step overflows when log2(scale) plus Gaussian noise (sd 1.5) passes ``level``, and bursts of 2-6
    overflows in a row start at random (probability ``p_burst`` per step). ``flags``: the flags it gave."""

    def __init__(self, seed, n, level=20, p_burst=0.02):
        self.rng, self.n, self.level, self.p_burst = random.Random(seed), n, level, p_burst
        self.burst = 0
        self.flags = []

    def __len__(self):
        return self.n

    def __call__(self, scale):
        rng = self.rng
        if self.burst == 0 and rng.random() < self.p_burst:
            self.burst = rng.randint(2, 6)
        if self.burst:
            self.burst -= 1
            flag = True
        else:
            flag = math.log2(scale) + rng.gauss(0.0, 1.5) > self.level
        self.flags.append(flag)
        return flag


#: bursts of overflows between clean runs shorter and longer than the default window (1000)
T, F = True, False
BURSTY_DEFAULT = ([T] * 3 + [F] * 1500 + [T, T, F, T, F, F, T, T, T] + [F] * 999 + [T] + [F] * 1000 + [T, T]
                  + [F] * 1001 + [T] * 4 + [F] * 1200 + [T, F, T, F, T])


# ----------------------------------------------------------------------------- deepspeed: defaults
def test_deepspeed_defaults_are_deepspeeds_config_defaults():
    args = DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args()
    assert args == {"init_scale": 2**16, "scale_window": 1000, "delayed_shift": 2, "consecutive_hysteresis": False,
                    "min_scale": 1}
    raise_default = inspect.signature(DynamicLossScaler).parameters["raise_error_at_min_scale"].default
    pol = ls.create("deepspeed", device="cpu").policy
    assert (pol.init_scale, pol.scale_window, pol.hysteresis, pol.consecutive_hysteresis, pol.min_scale,
            pol.raise_at_min_scale) == (args["init_scale"], args["scale_window"], args["delayed_shift"],
                                        args["consecutive_hysteresis"], args["min_scale"], raise_default)
    assert pol.skip_on_overflow and not pol.needs_grad_norm
    assert ls.accepted_params("deepspeed")["policy"] == sorted(
        ["init_scale", "scale_window", "hysteresis", "consecutive_hysteresis", "min_scale", "raise_at_min_scale"])
    assert pol.state_dict() == Zero().state


def test_deepspeed_fp16_defaults_are_what_the_engine_passes():
    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        lsc = fp16_loss_scale_config(cls, {})
        pol = ls.create("deepspeed-fp16", device="cpu").policy
        assert (pol.init_scale, pol.scale_window, pol.min_scale) == (lsc.cur_scale, lsc.scale_window,
                                                                     lsc.min_loss_scale) == (2**16, 1000, 1)
        assert lsc.scale_factor == 2.0 and lsc.dynamic_loss_scale
        assert pol.state_dict() == {"cur_iter": lsc.cur_iter, "last_overflow_iter": lsc.last_overflow_iter}
    assert ls.accepted_params("deepspeed-fp16")["policy"] == ["init_scale", "min_scale", "scale_window"]


# ----------------------------------------------------------------------------- deepspeed: the rule
@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_hand_derived_sequence(consecutive, rank0):
    cfg = dict(initial_scale_power=10, loss_scale_window=2, hysteresis=2, consecutive_hysteresis=consecutive)
    outcomes = [T, T, T, F, F, F, T, F, F, T, F, F, F, F, F]
    # T: hysteresis 2 -> 1, kept; T, T: halved (hysteresis stays 1); F, F, F: stable 0, 1, 2 -> grows at 2
    # (refilling the hysteresis); T: 2 -> 1, kept; F, F; then T: ...
    if not consecutive:  # ... the clean steps did not refill: halved; grows again at stable 2 and 4
        expected = [1024, 512, 256, 256, 256, 512, 512, 512, 512, 256, 256, 256, 512, 512, 1024]
    else:  # ... every clean step refilled it: 2 -> 1, kept
        expected = [1024, 512, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 1024, 1024, 2048]
    trace = side_by_side(Lab("deepspeed", **lab_params(cfg)), Zero(**cfg), outcomes)
    assert scales(trace) == expected
    assert [skipped for _, skipped in trace] == outcomes  # every overflow step skipped, absorbed or not
    assert rank0  # DeepSpeed asked for the rank (to log): the fixture is what lets it run here


def test_deepspeed_first_doubling_after_window_plus_one_clean_steps_one_later_than_gradscaler():
    """Default config (window 1000). From the start and after an overflow, the first doubling comes at the
    (window + 1)-th clean step, the next ones every window steps; GradScaler (growth_interval = window) doubles at
    the window-th clean step."""
    n = 2005
    outcomes = [False] * n + [True] + [False] * n
    trace = side_by_side(Lab("deepspeed"), Zero(), outcomes)
    assert len(trace) == len(outcomes)
    grew = growth_steps(trace, 2.0**16)
    overflow_at = n
    assert grew == [1000, 2000, overflow_at + 1001, overflow_at + 2001]  # index = clean steps so far - 1
    assert scales(trace)[overflow_at] == 2.0**18  # the hysteresis absorbed the overflow (and refilled at growth)

    gs = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1e-3)
    gs_trace = []
    for overflow in outcomes:
        opt.zero_grad()
        gs.scale(p.sum()).backward()
        if overflow:
            p.grad[1] = math.inf
        gs.step(opt)
        gs.update()
        gs_trace.append((gs.get_scale(), overflow))
    gs_grew = growth_steps(gs_trace, 2.0**16)
    assert gs_grew == [999, 1999, overflow_at + 1000, overflow_at + 2000]
    assert [d - g for d, g in zip(grew, gs_grew)] == [1, 1, 1, 1]


def test_deepspeed_bursty_overflows_default_config():
    trace = side_by_side(Lab("deepspeed"), Zero(), BURSTY_DEFAULT)
    assert len(trace) == len(BURSTY_DEFAULT)
    # clean runs of 999 and 1000 steps do not grow the scale; 1001 (window + 1) do
    assert growth_steps(trace, 2.0**16) == [1003, 4514, 5519]
    assert min(scales(trace)) == 16.0  # once spent, the hysteresis is only refilled by a growth


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_deepspeed_matches_zero_scaler_on_bursty_sequences(hysteresis, consecutive, window):
    cfg = dict(initial_scale_power=24, loss_scale_window=window, hysteresis=hysteresis,
               consecutive_hysteresis=consecutive)
    outcomes = Edge(f"{hysteresis}{consecutive}{window}", 700)
    trace = side_by_side(Lab("deepspeed", **lab_params(cfg)), Zero(**cfg), outcomes)
    s = scales(trace)
    assert len(trace) == len(outcomes), "hit the floor"
    assert 40 < sum(outcomes.flags) < 500
    assert growth_steps(trace, 2.0**24), "no growth exercised"
    assert any(b < a for a, b in zip(s, s[1:])), "no backoff exercised"
    absorbed = [i for i in range(1, len(s)) if outcomes.flags[i] and s[i] == s[i - 1]]
    assert bool(absorbed) == (hysteresis > 1), "the hysteresis absorbs overflows iff hysteresis > 1"


# ----------------------------------------------------------------------------- deepspeed: the floor
@pytest.mark.parametrize("hysteresis,expected", [
    (1, [4, 2, 1, RAISE]),       # halves at once; at the minimum the next overflow raises
    (2, [8, 4, 2, 1, RAISE]),    # the first overflow is absorbed; once spent the hysteresis stays at 1
    (3, [8, 8, 4, 2, 1, RAISE]),
])
def test_deepspeed_raises_at_the_minimum_where_deepspeed_raises(hysteresis, expected):
    cfg = dict(initial_scale_power=3, hysteresis=hysteresis)
    lab = Lab("deepspeed", **lab_params(cfg))
    trace = side_by_side(lab, Zero(**cfg), [True] * 20)
    assert scales(trace) == expected
    assert [skipped for _, skipped in trace] == [True] * len(expected)
    assert torch.equal(lab.p.detach(), torch.zeros(4))  # nothing was applied, the raising step included
    assert lab.scaler.steps == len(expected) and lab.scaler.skipped_steps == len(expected)


def test_deepspeed_floor_with_the_hysteresis_refilled_by_growth():
    cfg = dict(initial_scale_power=1, loss_scale_window=4, hysteresis=2)
    # 2: absorbed, then 1; the 5th clean step grows to 2 and refills the hysteresis: absorbed, 1, then spent at
    # the minimum: raise
    outcomes = [True, True] + [False] * 5 + [True, True, True, True]
    trace = side_by_side(Lab("deepspeed", **lab_params(cfg)), Zero(**cfg), outcomes)
    assert scales(trace) == [2, 1, 1, 1, 1, 1, 2, 2, 1, RAISE]


def test_deepspeed_consecutive_hysteresis_at_the_minimum_raises_only_on_back_to_back_overflows():
    cfg = dict(initial_scale_power=0, hysteresis=2, consecutive_hysteresis=True)
    outcomes = [True, False] * 50 + [True, True, True]
    trace = side_by_side(Lab("deepspeed", **lab_params(cfg)), Zero(**cfg), outcomes)
    assert scales(trace) == [1] * 101 + [RAISE]  # every clean step refills: only two overflows in a row raise


def test_deepspeed_non_power_of_two_minimum():
    cfg = dict(initial_scale_power=4, min_loss_scale=3, hysteresis=1)  # the config takes integers >= 1
    trace = side_by_side(Lab("deepspeed", **lab_params(cfg)), Zero(**cfg), [True] * 6)
    assert scales(trace) == [8, 4, 3, RAISE]


def test_deepspeed_without_raise_stays_at_the_minimum():
    direct = dict(init_scale=8, scale_window=3, min_scale=1, delayed_shift=2, consecutive_hysteresis=False,
                  raise_error_at_min_scale=False)
    lab = Lab("deepspeed", init_scale=8.0, scale_window=3, min_scale=1.0, hysteresis=2, raise_at_min_scale=False)
    outcomes = [True] * 10 + [False] * 4 + [True] * 3
    trace = side_by_side(lab, Zero(direct=direct), outcomes)
    assert scales(trace) == [8, 4, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 1, 1]


# ----------------------------------------------------------------------------- deepspeed: rounding
def test_deepspeed_scale_is_float32_of_deepspeeds_for_values_outside_fp32():
    """DeepSpeed's cur_scale is a Python float; the lab's is FP32. For init/min values that are not FP32 values
    (only reachable by building DynamicLossScaler directly) the lab's scale is float32(cur_scale) at every step,
    and the floor error comes at the same step."""
    direct = dict(init_scale=1000.1, scale_window=2, min_scale=0.3, delayed_shift=2, consecutive_hysteresis=False)
    lab = Lab("deepspeed", init_scale=1000.1, scale_window=2, min_scale=0.3, hysteresis=2)
    outcomes = [True] * 5 + [False] * 7 + [True] * 30
    trace = side_by_side(lab, Zero(direct=direct), outcomes,
                         expect=lambda e: e if e[0] == RAISE else (f32(e[0]), e[1]))
    assert trace[-1][0] == RAISE and 0.3 in scales(trace) and f32(0.3) != 0.3
    assert any(s != f32(s) for s in scales(trace) if s != RAISE)


def test_deepspeed_refuses_to_double_past_fp32_where_deepspeed_does_not():
    """The one deviation: DeepSpeed's Python float reaches 2**128 (an FP32 inf once it multiplies a tensor); the
    lab keeps 2**127 and moves the counters as DeepSpeed does."""
    cfg = dict(initial_scale_power=126, loss_scale_window=1)
    lab, ref = Lab("deepspeed", **lab_params(cfg)), Zero(**cfg)
    got = [lab.step(False) for _ in range(4)]
    want = [ref.step(False) for _ in range(4)]
    assert want == [(2.0**126, False), (2.0**127, False), (2.0**128, False), (2.0**129, False)]
    assert got == [(2.0**126, False), (2.0**127, False), (2.0**127, False), (2.0**127, False)]
    assert lab.state == ref.state


# ----------------------------------------------------------------------------- deepspeed: state, config
def test_deepspeed_resumes_from_state_dict_in_step_with_deepspeed():
    cfg = dict(initial_scale_power=20, loss_scale_window=5, hysteresis=3)
    edge = Edge("resume", 300)
    lab, ref = Lab("deepspeed", **lab_params(cfg)), Zero(**cfg)
    side_by_side(lab, ref, edge)
    outcomes = edge.flags
    lab, ref = Lab("deepspeed", **lab_params(cfg)), Zero(**cfg)
    side_by_side(lab, ref, outcomes[:137])
    state = lab.scaler.state_dict()
    assert {k: state[k] for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")} == ref.state
    resumed = Lab("deepspeed", **lab_params(cfg))
    resumed.scaler.load_state_dict(state)
    trace = side_by_side(resumed, ref, outcomes[137:])
    assert len(trace) == 300 - 137


@pytest.mark.parametrize("name,params,match", [
    ("deepspeed", {"hysteresis": 0}, "hysteresis"),
    ("deepspeed", {"scale_window": 0}, "scale_window"),
    ("deepspeed", {"min_scale": 0}, "min_scale"),
    ("deepspeed", {"min_scale": 2.0**17}, "min_scale"),
    ("deepspeed", {"init_scale": 2.0**200}, "init_scale"),
    ("deepspeed", {"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
    ("deepspeed", {"raise_at_min_scale": "yes"}, "raise_at_min_scale"),
    ("deepspeed", {"growth_interval": 10}, "growth_interval"),
    ("deepspeed-fp16", {"hysteresis": 2}, "hysteresis"),
    ("deepspeed-fp16", {"scale_window": 1.5}, "scale_window"),
    ("deepspeed-fp16", {"min_scale": -1}, "min_scale"),
])
def test_bad_parameters_are_refused(name, params, match):
    with pytest.raises(ls.ScalingConfigError, match=match):
        ls.create(name, device="cpu", **params)


# ----------------------------------------------------------------------------- deepspeed-fp16
FP16_CLASSES = pytest.mark.parametrize("cls", [FP16_Optimizer, FP16_UnfusedOptimizer], ids=["fused", "unfused"])


@FP16_CLASSES
def test_deepspeed_fp16_first_doubling_after_window_plus_one_and_bursty_default_config(cls):
    outcomes = [F] * 1005 + [T] * 3 + [F] * 1000 + [T, T, F, T] + [F] * 1001 + [T, F, T]
    trace = side_by_side(Lab("deepspeed-fp16"), FP16(cls), outcomes)
    assert len(trace) == len(outcomes)
    # the (window + 1)-th clean step, from the start and after overflows: 1000 clean steps are not enough
    assert growth_steps(trace, 2.0**16) == [1000, 3012]
    assert scales(trace)[1005:1008] == [2.0**16, 2.0**15, 2.0**14]  # no hysteresis: every overflow halves
    assert trace[-1] == (2.0**10, True)


@FP16_CLASSES
@pytest.mark.parametrize("window", [1, 2, 5])
def test_deepspeed_fp16_matches_the_optimizers_on_bursty_sequences(cls, window):
    # the optimisers ignore the config's hysteresis settings: the lab policy has none
    cfg = dict(initial_scale_power=12, loss_scale_window=window, hysteresis=3, consecutive_hysteresis=True)
    outcomes = Edge(f"fp16-{window}", 500)
    trace = side_by_side(Lab("deepspeed-fp16", init_scale=2.0**12, scale_window=window), FP16(cls, **cfg), outcomes)
    assert len(trace) == len(outcomes) and growth_steps(trace, 2.0**12)
    assert 30 < sum(outcomes.flags) < 300


@FP16_CLASSES
def test_deepspeed_fp16_stays_at_the_minimum(cls):
    cfg = dict(initial_scale_power=3, min_loss_scale=3, loss_scale_window=2)
    lab = Lab("deepspeed-fp16", init_scale=8.0, min_scale=3.0, scale_window=2)
    trace = side_by_side(lab, FP16(cls, **cfg), [True] * 6 + [False] * 4 + [True])
    assert scales(trace) == [4, 3, 3, 3, 3, 3, 3, 3, 6, 6, 3]


def test_deepspeed_fp16_refuses_to_double_past_fp32_where_deepspeed_does_not():
    """The optimisers' own _update_scale (called unbound: it reads only loss_scale_config and verbose)."""
    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        holder = types.SimpleNamespace(loss_scale_config=fp16_loss_scale_config(
            cls, dict(initial_scale_power=126, loss_scale_window=1)), verbose=False)
        lab = Lab("deepspeed-fp16", init_scale=2.0**126, scale_window=1)
        for i in range(4):
            cls._update_scale(holder, False)
            assert lab.step(False) == (min(2.0 ** (126 + max(i, 0)), 2.0**127), False)
            assert holder.loss_scale_config.cur_scale == 2.0 ** (126 + i)
        assert lab.state == {"cur_iter": 4, "last_overflow_iter": -1}


def test_policies_are_registered_by_lab_scaling():
    assert {"deepspeed", "deepspeed-fp16"} <= set(ls.available())
    assert issubclass(ScaleFloorReached, RuntimeError) and not issubclass(ScaleFloorReached, ls.ScalingConfigError)
    assert ls.create("deepspeed-fp16", device="cpu").get_scale() == 2.0**16


def test_a_lab_run_at_deepspeeds_floor_ends_with_a_status_not_a_traceback(tmp_path):
    """DeepSpeed raises and ends the run at its minimum scale; a lab run ends as 'diverged' with DeepSpeed's message,
    its steps.csv and metrics written and agreeing (the raising step counted as an overflow, skipped)."""
    import csv
    import json

    from lab.core.config import resolve_run, validate_study
    from lab.run.train import train
    from conftest import tiny_study
    study = tiny_study()
    study["modes"] = {"ds": {"precision": "fp16", "scaler": {"policy": "deepspeed", "init_scale": 2.0 ** 40,
                                                             "min_scale": 2.0 ** 39, "hysteresis": 1}}}
    study["train"].update(max_steps=6, census_every=0)
    cfg = resolve_run(validate_study(study), "resnet50", "ds", 0)
    m = train(cfg, tmp_path / "run")
    assert m["status"] == "diverged" and DEEPSPEED_FLOOR_MESSAGE in m["diverged_reason"]
    rows = list(csv.DictReader(open(tmp_path / "run" / "steps.csv")))
    assert [(r["found_inf"], r["skipped"]) for r in rows] == [("1", "1"), ("1", "1")]  # 2^40, then 2^39 = the floor
    assert m["steps"] == m["skipped_steps"] == m["overflow_steps"] == 2
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "diverged"

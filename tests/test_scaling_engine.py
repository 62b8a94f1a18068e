"""lab.scaling engine: GradScaler drop-in behaviour (call order, errors, multiple optimizers,
clipping, accumulation, disabled mode) and the one-fused-pass / one-sync-per-step promises."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import lab.scaling as ls
from conftest import DEVICES, CountingSGD

torch.set_num_threads(1)


def model_pair(seed=0, device="cpu"):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2)).to(device)
    return m, copy.deepcopy(m)


def data(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)


def loss_of(model, seed):
    x, y = data(seed)
    device = next(model.parameters()).device
    return nn.functional.mse_loss(model(x.to(device)), y.to(device))


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- call-order errors
def _misuse(kind, scaler, device="cpu"):
    """Run one misuse scenario on `scaler`; it must raise."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward():
        scaler.scale(model(torch.ones(2, 3, device=device)).sum()).backward()

    if kind == "unscale_twice":
        backward(); scaler.unscale_(opt); scaler.unscale_(opt)
    elif kind == "unscale_after_step":
        backward(); scaler.step(opt); scaler.unscale_(opt)
    elif kind == "step_twice":
        backward(); scaler.step(opt); scaler.step(opt)
    elif kind == "step_before_scale":
        model(torch.ones(2, 3, device=device)).sum().backward(); scaler.step(opt)
    elif kind == "unscale_before_scale":
        model(torch.ones(2, 3, device=device)).sum().backward(); scaler.unscale_(opt)
    elif kind == "update_before_scale":
        scaler.update()
    elif kind == "update_without_step":
        backward(); scaler.update()
    elif kind == "closure":
        backward(); scaler.step(opt, closure=lambda: None)
    elif kind == "fp16_grads":
        half = nn.Linear(3, 2).half().to(device)
        hopt = torch.optim.SGD(half.parameters(), lr=0.1)
        scaler.scale(half(torch.ones(2, 3, dtype=torch.float16, device=device)).float().sum()).backward()
        scaler.step(hopt)
    elif kind == "no_grads":
        scaler.scale(torch.ones((), device=device)); scaler.step(opt)
    elif kind == "scale_non_tensor":
        scaler.scale([torch.ones(2, device=device), 3.0])
    elif kind == "load_empty":
        scaler.load_state_dict({})
    elif kind == "new_scale_requires_grad":
        backward(); scaler.step(opt); scaler.update(torch.tensor(2.0, requires_grad=True, device=device))
    elif kind == "new_scale_two_elements":
        backward(); scaler.step(opt); scaler.update(torch.tensor([2.0, 3.0], device=device))
    else:
        raise AssertionError(kind)


MISUSES = ["unscale_twice", "unscale_after_step", "step_twice", "step_before_scale",
           "unscale_before_scale", "update_before_scale", "update_without_step", "closure",
           "fp16_grads", "no_grads", "scale_non_tensor", "load_empty", "new_scale_requires_grad",
           "new_scale_two_elements"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", MISUSES)
def test_call_order_errors_match_gradscaler(kind, device):
    with pytest.raises(Exception) as ref:
        _misuse(kind, torch.amp.GradScaler(device), device)
    with pytest.raises(Exception) as ours:
        _misuse(kind, ls.create("dynamic", device=device), device)
    assert type(ours.value) is type(ref.value), (kind, ours.value, ref.value)
    if kind == "fp16_grads":  # torch's words first (users search for them), then the fix (lab/scaling/adapters.py)
        assert str(ours.value).startswith(str(ref.value) + " ") and "autocast_adapter_dtype=True" in str(ours.value)
    else:
        assert str(ours.value) == str(ref.value)


def test_expected_exception_types_for_the_main_rules():
    s = ls.create("gradnorm", device="cpu")
    with pytest.raises(RuntimeError, match="already been called"):
        _misuse("unscale_twice", s)
    with pytest.raises(ValueError, match="FP16"):
        _misuse("fp16_grads", ls.create("static", device="cpu"))


def test_update_then_next_iteration_is_allowed_again():
    m, _ = model_pair()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ls.create("dynamic", device="cpu")
    for i in range(3):
        opt.zero_grad()
        s.scale(loss_of(m, i)).backward()
        s.unscale_(opt)
        s.step(opt)
        s.update()
    assert s.steps == 3


# ----------------------------------------------------------------------------- scale(), get_scale()
def test_scale_nested_outputs_like_gradscaler():
    a, b, c = torch.tensor(1.5), torch.tensor([2.0, -3.0]), torch.tensor(0.25, dtype=torch.float64)
    outs = [a, (b, [c]), (a,)]
    ours = ls.create("static", scale=8.0, device="cpu").scale(outs)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0).scale(outs)
    assert type(ours) is list and type(ours[1]) is tuple and type(ours[1][1]) is list
    assert torch.equal(ours[0], a * 8) and torch.equal(ours[1][0], b * 8)
    assert torch.equal(ours[1][1][0], ref[1][1][0]) and ours[1][1][0].dtype == torch.float64
    gen = ls.create("static", scale=4.0, device="cpu").scale(x for x in (a, b))
    assert [t.tolist() for t in gen] == [6.0, [8.0, -12.0]]


def test_get_scale_before_first_scale_disabled_and_fp32_storage():
    s = ls.create("dynamic", device="cpu", init_scale=0.1)
    assert s.get_scale() == 0.1  # like GradScaler: the init value before scale()
    s.scale(torch.ones(()))
    assert s.get_scale() == torch.tensor(0.1, dtype=torch.float32).item() != 0.1
    assert s._scale.dtype == torch.float32
    assert ls.create("dynamic", device="cpu").get_scale() == 2.0**16
    assert ls.create("none", device="cpu").get_scale() == 1.0
    assert ls.create("static", device="cpu", scale=64.0, enabled=False).get_scale() == 1.0


def test_disabled_scaler_is_a_pass_through():
    s = ls.create("static", scale=1024.0, device="cpu", enabled=False)
    assert not s.is_enabled()
    m, _ = model_pair()
    opt = CountingSGD(m.parameters(), lr=0.1)
    loss = loss_of(m, 0)
    assert s.scale(loss) is loss
    loss.backward()
    m[0].weight.grad[0, 0] = math.inf
    grads = [p.grad.clone() for p in m.parameters()]
    s.unscale_(opt)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters()))
    s.step(opt)
    assert opt.calls == 1 and torch.isinf(m[0].weight[0, 0])  # not skipped
    s.update()
    s.update()  # no call-order rules when disabled
    assert s.state_dict() == {} and s.steps == 0 and s.skipped_steps == 0
    s.load_state_dict({})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_disables_with_warning_like_gradscaler():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        s = ls.create("dynamic", device="cuda")
    assert not s.is_enabled()
    assert ls.create("dynamic")._device == "cpu"  # default device when CUDA is absent
    with pytest.warns(UserWarning):
        assert not ls.create("static", device="cuda:0").is_enabled()
    assert ls.create("static", device=torch.device("cpu")).is_enabled()
    with pytest.raises(ValueError, match="device"):
        ls.create("static", device="gpu-please")


# ----------------------------------------------------------------------------- multiple optimizers
@pytest.mark.parametrize("device", DEVICES)
def test_two_optimizers_skip_independently_and_scale_backs_off_once(device):
    m_lab, m_ref = model_pair(3, device)
    sides = []
    for m, scaler in ((m_lab, ls.create("dynamic", device=device, init_scale=1024.0, growth_interval=2)),
                      (m_ref, torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2))):
        o1 = CountingSGD(m[0].parameters(), lr=0.1)
        o2 = CountingSGD(m[2].parameters(), lr=0.1)
        sides.append((m, scaler, o1, o2))
    for it, bad in enumerate([None, "first", None, "second", "both", None, None]):
        before = [snapshot(m) for m, *_ in sides]
        for m, scaler, o1, o2 in sides:
            o1.zero_grad(); o2.zero_grad()
            scaler.scale(loss_of(m, it)).backward()
            if bad in ("first", "both"):
                m[0].weight.grad[1, 1] = math.nan
            if bad in ("second", "both"):
                m[2].bias.grad[0] = -math.inf
            scale_before = scaler.get_scale()
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
            if bad:  # backed off exactly once, however many optimizers overflowed
                assert scaler.get_scale() == scale_before * 0.5
        (m_l, s_l, a_l, b_l), (m_r, s_r, a_r, b_r) = sides
        assert (a_l.calls, b_l.calls) == (a_r.calls, b_r.calls)
        assert s_l.get_scale() == s_r.get_scale()
        assert all(torch.equal(x, y) for x, y in zip(m_l.parameters(), m_r.parameters()))
        first_moved = not torch.equal(before[0][0], m_l[0].weight)
        second_moved = not torch.equal(before[0][2], m_l[2].weight)
        assert first_moved == (bad not in ("first", "both"))
        assert second_moved == (bad not in ("second", "both"))
        assert s_l.last_found_inf == s_l.last_step_skipped == (bad is not None)
    assert s_l.skipped_steps == 3 and s_l.overflow_steps == 3 and s_l.max_consecutive_skips == 2


def test_optimizer_unscaled_but_not_stepped_still_counts():
    m, _ = model_pair()
    o1 = torch.optim.SGD(m[0].parameters(), lr=0.1)
    o2 = torch.optim.SGD(m[2].parameters(), lr=0.1)
    s = ls.create("dynamic", device="cpu", init_scale=256.0)
    s.scale(loss_of(m, 0)).backward()
    m[2].weight.grad[0, 0] = math.inf
    s.step(o1)
    s.unscale_(o2)  # inspected, never stepped: its overflow must still back the scale off
    s.update()
    assert s.get_scale() == 128.0 and s.last_found_inf


# ----------------------------------------------------------------------------- clipping, accumulation
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,params", [("dynamic", {}), ("static", {"scale": 4096.0}),
                                         ("gradnorm", {"init_scale": 512.0})])
def test_clipping_after_unscale_sees_true_gradients(name, params, device):
    m_lab, m_ref = model_pair(4, device)
    o_lab = torch.optim.SGD(m_lab.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1)
    s = ls.create(name, device=device, **params)
    for it in range(5):
        o_lab.zero_grad(); o_ref.zero_grad()
        s.scale(loss_of(m_lab, it)).backward()
        s.unscale_(o_lab)
        norm_lab = nn.utils.clip_grad_norm_(m_lab.parameters(), 0.05)
        loss_of(m_ref, it).backward()  # plain FP32 reference, no scaler
        norm_ref = nn.utils.clip_grad_norm_(m_ref.parameters(), 0.05)
        # power-of-two scales unscale exactly: the clip sees the true (unscaled) gradients
        assert torch.equal(norm_lab, norm_ref)
        s.step(o_lab)
        s.update()
        o_ref.step()
        assert all(torch.equal(a, b) for a, b in zip(m_lab.parameters(), m_ref.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_steps_only_on_stepping_iterations(device):
    accum = 4
    m_lab, m_ref = model_pair(5, device)
    m_pt = copy.deepcopy(m_lab)
    o_lab = CountingSGD(m_lab.parameters(), lr=0.1, momentum=0.9)
    o_ref = CountingSGD(m_ref.parameters(), lr=0.1, momentum=0.9)
    o_pt = CountingSGD(m_pt.parameters(), lr=0.1, momentum=0.9)
    s = ls.create("dynamic", device=device, growth_interval=2)
    s_pt = torch.amp.GradScaler(device, growth_interval=2)
    for micro in range(6 * accum):
        for model, scaler in ((m_lab, s), (m_pt, s_pt)):
            scaler.scale(loss_of(model, micro) / accum).backward()
        loss_of(m_ref, micro).div(accum).backward()
        if (micro + 1) % accum == 0:
            for model, opt, scaler in ((m_lab, o_lab, s), (m_pt, o_pt, s_pt)):
                if micro == 2 * accum - 1:
                    model[0].bias.grad[2] = math.inf  # one overflowing accumulated step
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            if micro != 2 * accum - 1:
                nn.utils.clip_grad_norm_(m_ref.parameters(), 1.0)
                o_ref.step()
            o_ref.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(m_lab.parameters(), m_ref.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(m_lab.parameters(), m_pt.parameters()))
            assert s.get_scale() == s_pt.get_scale()
    assert s.steps == 6 and o_lab.calls == 5 == o_ref.calls and s.skipped_steps == 1


# ----------------------------------------------------------------------------- fused pass, one sync
def test_unscale_is_one_fused_call_per_device_and_dtype(monkeypatch):
    calls = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def spy(grads, found_inf, inv_scale):
        calls.append((len(grads), grads[0].dtype))
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", spy)
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    s = ls.create("dynamic", device="cpu")
    s.scale(b(a(torch.ones(1, 4)).double()).sum()).backward()
    s.step(opt)
    s.update()
    assert sorted(calls, key=str) == sorted([(2, torch.float32), (2, torch.float64)], key=str)


class SyncCounter:
    """Counts device->host reads (item/tolist/bool/float/int) of tensors."""

    def __init__(self, monkeypatch):
        self.n = 0
        for meth in ("item", "tolist", "__bool__", "__float__", "__int__"):
            real = getattr(torch.Tensor, meth)

            def wrapped(t, *a, _real=real, **k):
                self.n += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, meth, wrapped)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["dynamic", "gradnorm", "hysteresis", "warmup", "static", "none", "amax-history",
                                  "deepspeed", "deepspeed-fp16"])
def test_one_host_sync_per_step_and_none_in_update(monkeypatch, name, device):
    """Every shipped policy: unscale_ reads nothing to the host, step reads once (the found-inf flag with, for
    amax-history and gradnorm, the gradients' maximum or norm in the same transfer), update and get_scale none
    (on CUDA each read is a synchronisation)."""
    m, _ = model_pair(6, device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, foreach=True)
    s = ls.create(name, device=device)
    counter = SyncCounter(monkeypatch)
    for it in range(6):
        opt.zero_grad()
        s.scale(loss_of(m, it)).backward()
        if it == 3:
            m[2].weight.grad[0, 0] = math.inf
        n0 = counter.n
        s.unscale_(opt)
        assert counter.n == n0, "unscale_ must not synchronise"
        s.step(opt)
        assert counter.n == n0 + 1, "step: exactly one synchronisation"
        s.update()
        s.get_scale()
        assert counter.n == n0 + 1, "update/get_scale must reuse the synced flag"
    if name == "none":  # the inf step was applied, so the parameters stay non-finite afterwards
        assert s.overflow_steps == 3 and s.skipped_steps == 0
    else:
        assert s.overflow_steps == s.skipped_steps == 1
    if name == "gradnorm":
        assert s.last_grad_norm is not None and math.isfinite(s.last_grad_norm)


@pytest.mark.parametrize("fused", [False, True])
def test_gradnorm_fetches_the_true_unscaled_norm(fused):
    m, ref = model_pair(8)
    if fused:  # the optimizer unscales itself; the engine must still report the unscaled norm
        opt = torch.optim.Adam(m.parameters(), lr=0.0, fused=True)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
    s = ls.create("gradnorm", device="cpu", init_scale=2.0**12)
    s.scale(loss_of(m, 1)).backward()
    s.step(opt)
    s.update()
    loss_of(ref, 1).backward()
    true = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
    assert s.last_grad_norm == pytest.approx(true.item(), rel=1e-5)


# ----------------------------------------------------------------------------- bf16 grads / counters
def test_bfloat16_gradients_are_unscaled_like_gradscaler():
    torch.manual_seed(2)
    m = nn.Linear(4, 3).to(torch.bfloat16)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    s, s2 = ls.create("dynamic", device="cpu", init_scale=64.0), torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4).to(torch.bfloat16)
    for model, opt, scaler in ((m, o, s), (m2, o2, s2)):
        scaler.scale(model(x).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_update_ratio_and_counters_start_clean():
    s = ls.create("dynamic", device="cpu")
    assert (s.steps, s.overflow_steps, s.skipped_steps, s.consecutive_skips, s.max_consecutive_skips,
            s.alerts, s.fallback_step, s.fp32_fallback, s.last_found_inf, s.last_step_skipped) == \
        (0, 0, 0, 0, 0, 0, None, False, False, False)
    assert s.update_ratio == 1.0
    assert set(ls.create("warmup", device="cpu").state_dict()) == \
        {"scale", "policy", "growth_tracker", *ls.COUNTER_KEYS}
    s.scale(torch.ones(()))
    sd = s.state_dict()
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker", *ls.COUNTER_KEYS):
        assert key in sd

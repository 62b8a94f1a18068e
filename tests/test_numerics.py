"""lab.numerics: the FP16 census, log2 histograms, and the training-loop monitor."""
import csv
import functools
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from lab import numerics
from lab.config import ConfigError, resolve_run, validate_study
from lab.numerics import (CENSUS_COLUMNS, HIST_COLUMNS, Census, NumericsMonitor, Tally, census,
                          log2_histogram)
from lab.train import STEP_FIELDS, train

from conftest import tiny_study

F16 = torch.finfo(torch.float16)
SCALES = (1.0, 128.0, 1024.0, 65536.0)
CLASSES = ("zero", "underflow", "subnormal", "normal", "overflow")


# --- an independent reference: cast to FP16, then look at the result ----------------------------------------
def fp16_of(x: torch.Tensor, scale: float) -> torch.Tensor:
    """round16(scale * x). FP32 (and narrower) values: scale * x in FP32 is exact for a power-of-two scale
    (or overflows FP32, an FP16 overflow too) and torch's FP32 -> FP16 cast rounds correctly. FP64 and
    other scales: the float64 product (exact for FP32 values times a small-mantissa scale) cast by numpy,
    which rounds once (torch's FP64 -> FP16 cast goes through FP32 and can round twice)."""
    if x.dtype != torch.float64 and math.log2(scale).is_integer():
        return (x.float() * scale).to(torch.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy((x.double().numpy() * scale).astype(np.float16))


def reference_classes(x: torch.Tensor, scale: float = 1.0) -> list[str]:
    h = fp16_of(x, scale).double()
    x64 = x.double()
    out = []
    for xv, hv in zip(x64.tolist(), h.tolist()):
        if not math.isfinite(xv) or math.isinf(hv):
            out.append("overflow")
        elif xv == 0:
            out.append("zero")
        elif hv == 0:
            out.append("underflow")
        elif abs(hv) < F16.smallest_normal:
            out.append("subnormal")
        else:
            out.append("normal")
    return out


def reference_census(x: torch.Tensor, scale: float = 1.0) -> Census:
    cls = reference_classes(x.reshape(-1), scale)
    return Census(total=len(cls), **{c: cls.count(c) for c in CLASSES})


def only_class(c: Census) -> str:
    assert c.total == 1 and sum(getattr(c, k) for k in CLASSES) == 1, c
    return next(k for k in CLASSES if getattr(c, k))


def around(values, dtype) -> torch.Tensor:
    """Each value, one ulp of ``dtype`` below and above it, and the negatives of all of these."""
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    below = torch.nextafter(t, torch.zeros_like(t))
    above = torch.nextafter(t, torch.full_like(t, math.inf))
    pos = torch.cat([below, t, above])
    return torch.cat([pos, -pos])


BOUNDARIES = [2.0 ** -25, 2.0 ** -24, F16.smallest_normal - 2.0 ** -25, F16.smallest_normal, F16.max, 65520.0]
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan]


def test_bounds_come_from_finfo():
    assert numerics.SMALLEST_SUBNORMAL == 2.0 ** -24 and numerics.UNDERFLOW_BOUND == 2.0 ** -25
    assert numerics.NORMAL_BOUND == 2.0 ** -14 - 2.0 ** -25 and numerics.OVERFLOW_BOUND == 65520.0
    # what they mean, for a correctly rounding FP32 -> FP16 cast
    t = torch.tensor([2.0 ** -25, numerics.NORMAL_BOUND, 65520.0]).to(torch.float16).tolist()
    assert t == [0.0, 2.0 ** -14, math.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", SCALES)
def test_every_boundary_one_ulp_either_side(dtype, scale, device):
    x = torch.cat([around([b / scale for b in BOUNDARIES], dtype), torch.tensor(SPECIALS, dtype=dtype)])
    expected = reference_classes(x, scale)
    got = [only_class(census(v, scale=scale)) for v in x.to(device)]
    assert got == expected
    assert census(x.to(device), scale=scale) == reference_census(x, scale)
    # spot checks that do not depend on the reference
    hit = dict(zip(x.tolist(), got))
    assert hit[2.0 ** -25 / scale] == "underflow" and hit[2.0 ** -14 / scale] == "normal"
    assert hit[F16.max / scale] == "normal" and hit[65520.0 / scale] == "overflow"
    assert got[-5:] == ["zero", "zero", "overflow", "overflow", "overflow"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_boundaries_in_16_bit_dtypes(dtype, device):
    x = torch.cat([around(BOUNDARIES[1:] + [1.0, 2.0 ** -20], dtype), torch.tensor(SPECIALS, dtype=dtype)])
    for scale in SCALES + (2.0 ** -3,):
        assert [only_class(census(v, scale=scale)) for v in x.to(device)] == reference_classes(x, scale), scale


def spanning(n: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-60, 40, (n,), generator=g).double())
    x = x.to(dtype)
    x[:len(SPECIALS)] = torch.tensor(SPECIALS, dtype=dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_random_tensors_spanning_many_binades(dtype, device):
    x = spanning(20_000, dtype, seed=1)
    for scale in SCALES:
        assert census(x.to(device), scale=scale) == reference_census(x, scale), scale
    if dtype != torch.float64:  # a scale that is not a power of two: float64 products still exact
        assert census(x.to(device), scale=3.0) == reference_census(x, 3.0)
    c = census(x.to(device))
    assert c.total == x.numel() == sum(getattr(c, k) for k in CLASSES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_log2_histogram_matches_frexp(dtype, device):
    x = spanning(20_000, dtype, seed=2)
    x64 = x.double().numpy()
    finite = np.isfinite(x64) & (x64 != 0)
    k = np.frexp(np.abs(x64[finite]))[1] - 1  # floor(log2|x|), exact
    for lo, hi in ((-40, 20), (-3, 4), (0, 1)):
        h = log2_histogram(x.to(device), lo=lo, hi=hi)
        kk = np.clip(k, lo, hi - 1)
        assert list(h.counts) == [int((kk == b).sum()) for b in range(lo, hi)]
        assert h.zero == int((x64 == 0).sum()) and h.nonfinite == int((~np.isfinite(x64)).sum())
        assert h.total == x.numel()
    exact = log2_histogram(torch.tensor([1.0, 1.9999999, 2.0, 0.5, 2.0 ** -40, 2.0 ** -41, 2.0 ** 25]), -40, 20)
    d = exact.as_dict()
    assert (d[0], d[1], d[-1], d[-40], d[19]) == (2, 1, 1, 2, 1)


def test_batched_equals_sum_of_parts(device):
    parts = [spanning(3000, torch.float32, 3), spanning(500, torch.float16, 4).reshape(10, 50),
             spanning(700, torch.bfloat16, 5), torch.zeros(0), spanning(100, torch.float64, 6)]
    parts = [p.to(device) for p in parts]
    for scale in (1.0, 1024.0):
        total = Census()
        for p in parts:
            total = total + census(p, scale=scale)
        assert census(parts, scale=scale) == total
    hist = log2_histogram(parts[0]) + log2_histogram(parts[1]) + log2_histogram(parts[2]) + log2_histogram(parts[4])
    assert log2_histogram(parts) == hist
    assert census([]) == Census() and census(torch.zeros(0)).total == 0


def test_counterfactual_scales_on_a_crafted_tensor(device):
    x = torch.tensor([0.0, 2.0 ** -40, 2.0 ** -30, 2.0 ** -26, 2.0 ** -20, 2.0 ** -12, 0.5, 1.0, 100.0, 600.0,
                      math.inf, math.nan])
    expected = {  # zero, underflow, subnormal, normal, overflow; worked out by hand
        1.0: (1, 3, 1, 5, 2),        # 2^-40, 2^-30, 2^-26 flush; 2^-20 is subnormal
        128.0: (1, 1, 2, 5, 3),      # 600 * 128 = 76800 overflows
        1024.0: (1, 1, 2, 4, 4),     # 100 * 1024 overflows too
        65536.0: (1, 0, 1, 5, 5),    # 2^-40 -> 2^-24, the smallest subnormal; 1.0 -> 65536 overflows
    }
    x = x.to(device)
    tally = Tally(scales=SCALES)
    tally.add("x", x)
    res = tally.result()["x"]
    for scale, counts in expected.items():
        want = Census(12, *counts)
        assert census(x, scale=scale) == want == res.census(scale), scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["histc", "index_put"])
def test_gpu_count_methods_agree_with_bincount(dtype, method):
    """The GPU counting paths (histc; index_put under deterministic algorithms), run on CPU tensors: same
    bins as bincount for every dtype's keys, including the largest key (NaN) and plans with split bins."""
    int_dtype = {16: torch.int16, 32: torch.int32, 64: torch.int64}[torch.finfo(dtype).bits]
    all_ones = torch.full((2,), -1, dtype=int_dtype).view(dtype)  # NaNs with every bit set: the largest key
    x = torch.cat([spanning(20_000, dtype, seed=7), all_ones])
    for scales, hist in (((1.0,), None), (SCALES + (3.0,), (-40, 20))):
        plan = numerics._plan(dtype, x.device, scales, hist, 1.0)
        assert plan.nbins & (plan.nbins - 1) == 0 and plan.nbins < 2 ** 24  # histc's exactness needs both
        want = plan.bins(x, method="bincount")
        assert torch.equal(plan.bins(x, method=method), want)
        assert int(want.sum()) == x.numel() and int(want[-plan.stride:].sum()) >= 2
    assert numerics.count_method(torch.device("cpu")) == "bincount"
    assert numerics.count_method(torch.device("cuda")) == "histc"
    try:
        torch.use_deterministic_algorithms(True)
        assert numerics.count_method(torch.device("cuda")) == "index_put"
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match="count method"):
        numerics._count(torch.zeros(3, dtype=torch.int16), 8, "sort")


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        census(torch.ones(3), scale=0.0)
    with pytest.raises(ValueError, match="lo < hi"):
        log2_histogram(torch.ones(3), lo=3, hi=3)
    with pytest.raises(TypeError):
        census(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="census_every"):
        NumericsMonitor(nn.Linear(2, 2), -1)


class SyncCounter:
    """Counts the Tensor methods that copy a value to the host."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *a, _orig=orig, _name=name, **k):
                self.calls.append(_name)
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, wrapper)


def test_one_host_sync_for_many_tensors(monkeypatch):
    parts = [torch.randn(1000) * 1e-6 for _ in range(20)] + [torch.randn(50).half() for _ in range(5)]
    census(parts, scale=128.0)  # thresholds are computed (on the host) once per dtype and scale, then cached
    Tally(scales=SCALES, hist=(-40, 20)).add(0, parts)
    counter = SyncCounter(monkeypatch)
    c = census(parts, scale=128.0)
    assert counter.calls == ["tolist"] and c.total == 20_250
    counter.calls.clear()
    tally = Tally(scales=SCALES, hist=(-40, 20))
    for i, p in enumerate(parts):
        tally.add(i % 3, p)
    assert counter.calls == []   # adding never syncs
    tally.result()
    assert counter.calls == ["tolist"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_tally_never_syncs_until_result(deterministic):
    parts = [torch.randn(1000, device="cuda") * 1e-6 for _ in range(20)] + \
        [torch.randn(50, device="cuda").half() for _ in range(5)]
    try:
        torch.use_deterministic_algorithms(deterministic)
        Tally(scales=SCALES, hist=(-40, 20)).add(0, parts)  # thresholds cached (host work, once)
        tally = Tally(scales=SCALES, hist=(-40, 20))
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
        try:
            for i, p in enumerate(parts):
                tally.add(i % 3, p)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        res = tally.result()
    finally:
        torch.use_deterministic_algorithms(False)
    for key in range(3):
        cpu = [p.cpu() for i, p in enumerate(parts) if i % 3 == key]
        assert res[key].census(128.0) == census(cpu, scale=128.0)


# --- the monitor --------------------------------------------------------------------------------------------
def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Identity(),                                # acts on the input: no gradient flows there
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Identity(),                                # passes the very same tensor on
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(0.0), nn.Linear(16, 3))


def leaves_with_grad_outputs(model, x):
    """Leaf modules whose output takes part in backward, found with plain forward hooks."""
    names = set()
    handles = [m.register_forward_hook(lambda m, a, out, n=n: names.add(n) if out.requires_grad else None)
               for n, m in model.named_modules() if not list(m.children())]
    model(x)
    for h in handles:
        h.remove()
    return names


def census_step(model, x, y, monitor, step=0, precision="fp32", scale=1.0):
    monitor.begin_step(step, scale, precision)
    loss = nn.functional.cross_entropy(model(x), y) * scale
    loss.backward()
    monitor.after_backward()


def rows_by_layer(monitor, source, at_scale=1.0):
    return {r["layer"]: Census(*(r[k] for k in ("total", *CLASSES))) for r in monitor.census_rows
            if r["source"] == source and r["at_scale"] == at_scale}


def test_hooks_capture_every_leaf_module_and_match_tensor_hooks(device):
    model = small_model().to(device)
    x, y = torch.randn(8, 1, 6, 6, device=device), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], device=device)
    expected = leaves_with_grad_outputs(model, x)
    assert expected == {str(i) for i in range(1, 11)}  # all but the input Identity

    # independent capture: output.register_hook on every leaf's outputs
    grads = {}

    def capture(name, module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: grads.setdefault(name, []).append(g.clone()))
    handles = [m.register_forward_hook(functools.partial(capture, n))
               for n, m in model.named_modules() if not list(m.children())]
    monitor = NumericsMonitor(model, every=1)
    census_step(model, x, y, monitor)
    assert monitor.end_step(found_inf=False) == ""
    for h in handles:
        h.remove()

    act = rows_by_layer(monitor, "activation_grad")
    assert set(act) - {"__total__"} == expected == set(grads)
    for scale in SCALES:
        rows = rows_by_layer(monitor, "activation_grad", scale)
        for name, gs in grads.items():
            assert rows[name] == census(gs, scale=scale), (name, scale)
    # the Identity after the in-place ReLU and Dropout(0) pass the same tensor on: their rows repeat its
    # counts, and the total counts it once
    assert act["4"] == act["3"] and act["3"] != act["2"] and act["9"] == act["8"]
    distinct = [g for n, gs in grads.items() if n not in ("4", "9") for g in gs]
    assert act["__total__"] == census(distinct)
    par = rows_by_layer(monitor, "param_grad")
    assert set(par) == {"1", "2", "5", "10", "__total__"}
    assert par["10"] == census([p.grad for p in model[10].parameters()])
    assert par["__total__"] == census([p.grad for p in model.parameters()])
    # histogram rows: totals per source, every bin plus zero and nonfinite
    hist = monitor.hist_rows
    act_hist = {r["log2_bin"]: r["count"] for r in hist if r["source"] == "activation_grad"}
    assert len(act_hist) == 62 and sum(act_hist.values()) == act["__total__"].total
    assert act_hist == log2_histogram(distinct).as_dict()


def test_timm_resnet_in_place_activations():
    from lab.models import create_model
    model = create_model("resnet50-digits", num_classes=10, in_chans=1, image_size=16)
    for m in model.modules():  # timm zero-initialises each block's last BN: let gradients through
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
    x, y = torch.randn(4, 1, 16, 16), torch.arange(4)
    expected = leaves_with_grad_outputs(model, x)
    monitor = NumericsMonitor(model, every=1)
    census_step(model, x, y, monitor)
    monitor.end_step(False)
    act = rows_by_layer(monitor, "activation_grad")
    assert set(act) - {"__total__"} == expected and "layer1.0.act1" in expected
    assert act["layer1.0.act1"] != act["layer1.0.bn1"]  # grad after the in-place ReLU vs before it
    assert act["fc"].total == 4 * 10


def test_monitor_syncs_once_per_census_step_and_hooks_only_then(monkeypatch):
    model = small_model()
    x, y = torch.randn(8, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    monitor = NumericsMonitor(model, every=2, attribute=True)
    census_step(model, x, y, monitor, step=0)
    monitor.end_step(False)  # warm: thresholds cached
    model.zero_grad()
    counter = SyncCounter(monkeypatch)
    census_step(model, x, y, monitor, step=2)
    assert counter.calls == []
    monitor.end_step(False)
    assert counter.calls == ["tolist"]
    counter.calls.clear()
    monitor.begin_step(3, 1.0, "fp32")  # not a census step: no hooks at all
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    nn.functional.cross_entropy(model(x), y).backward()
    monitor.after_backward()
    assert monitor.end_step(False) == "" and counter.calls == []
    assert monitor.census_steps == 2 and {r["step"] for r in monitor.census_rows} == {0, 2}


class InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


class Planted(nn.Module):
    """A linear layer whose backward can be made to produce inf."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)
        self.armed = False

    def forward(self, x):
        y = x @ self.weight.t()
        return InfGrad.apply(y) if self.armed else y


def planted_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), Planted(8), nn.GELU(), Planted(8), nn.LayerNorm(8),
                         nn.Linear(8, 3))


@pytest.mark.parametrize("where", [2, 4])
def test_overflow_attribution_names_the_planted_layer(where, device):
    model = planted_model().to(device)
    params = list(model.parameters())
    x, y = torch.randn(5, 6, device=device), torch.tensor([0, 1, 2, 0, 1], device=device)
    scaler = numerics_scaler(device.type)
    monitor = NumericsMonitor(model, every=10, attribute=True)
    opt = torch.optim.SGD(params, lr=0.0)
    first = []
    for step in range(3):  # step 0 is a clean census step (it records the backward order)
        model[where].armed = step >= 1
        monitor.begin_step(step, scaler.get_scale(), "fp16")
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        monitor.after_backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        first.append(monitor.end_step(scaler.last_found_inf))
        opt.zero_grad(set_to_none=True)
    assert first == ["", str(where), str(where)]
    assert monitor.finish()["first_overflow_step"] == 1 and monitor.first_nonfinite_layer == str(where)


def test_overflow_attribution_at_the_head_and_without_a_census_yet():
    model = planted_model()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    monitor = NumericsMonitor(model, every=1, attribute=True)
    monitor.begin_step(0, 2.0 ** 200, "fp32")
    (nn.functional.cross_entropy(model(x), y) * 2.0 ** 200).backward()  # inf gradient from the loss down
    monitor.after_backward()
    assert monitor.end_step(found_inf=True) == "6"
    fresh = NumericsMonitor(model, every=1000, attribute=True)  # no backward order recorded yet
    fresh.begin_step(1, 1.0, "fp32")
    assert fresh.end_step(found_inf=True) == "6"  # reverse definition order


def numerics_scaler(device="cpu"):
    from lab import scaling
    return scaling.create("static", scale=1024.0, device=device)


# --- in the training loop -----------------------------------------------------------------------------------
def run(tmp_path, mode, mode_def=None, model="resnet50", device="auto", **train_overrides):
    study = tiny_study(device=device)
    if mode_def:
        study["modes"][mode] = mode_def
    study["train"].update(train_overrides)
    cfg = resolve_run(validate_study(study), model, mode, 0)
    out = tmp_path / f"{model}-{mode}"
    return train(cfg, out), out


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def check_census_files(out, steps, at_scales, scale):
    rows = read_csv(out / "census.csv")
    assert list(rows[0]) == CENSUS_COLUMNS
    assert {int(r["step"]) for r in rows} == steps
    assert {r["source"] for r in rows} == {"activation_grad", "param_grad"}
    assert {float(r["at_scale"]) for r in rows} == at_scales and {float(r["scale"]) for r in rows} == {scale}
    for r in rows:
        assert int(r["total"]) == sum(int(r[k]) for k in CLASSES)
    totals = {(r["step"], r["source"], float(r["at_scale"])): int(r["total"]) for r in rows
              if r["layer"] == "__total__"}
    assert len(totals) == len(steps) * 2 * len(at_scales)
    hist = read_csv(out / "grad_hist.csv")
    assert list(hist[0]) == HIST_COLUMNS
    for (step, source, _), total in totals.items():
        counts = [int(h["count"]) for h in hist if h["step"] == step and h["source"] == source]
        assert len(counts) == 62 and sum(counts) == total
    return rows


def test_training_run_writes_census_files_fp32_and_fp16(tmp_path):
    metrics, out = run(tmp_path, "fp32", census_every=2)
    rows = check_census_files(out, {0, 2}, set(SCALES), 1.0)
    assert metrics["census_every"] == 2 and metrics["census_steps"] == 2
    assert metrics["first_overflow_step"] is None and metrics["first_nonfinite_layer"] is None
    layers = {r["layer"] for r in rows}
    assert {"conv1", "fc", "layer1.0.act1", "__total__"} <= layers
    # counterfactual: the same gradients at a higher scale never underflow more
    t = {float(r["at_scale"]): int(r["underflow"]) for r in rows
         if r["layer"] == "__total__" and r["source"] == "activation_grad" and r["step"] == "0"}
    assert t[1.0] >= t[128.0] >= t[1024.0] >= t[65536.0]
    assert not list(out.glob("*.tmp"))

    metrics, out = run(tmp_path, "fp16-static128", census_every=1, model="vit")
    rows = check_census_files(out, {0, 1, 2}, {128.0}, 128.0)
    assert all(r["underflow"] == "0" for r in rows if r["source"] == "activation_grad"
               and r["layer"] in ("blocks.0.attn.qkv", "head"))  # FP16 tensors: already rounded
    steps = read_csv(out / "steps.csv")
    assert list(steps[0]) == STEP_FIELDS and all(s["first_nonfinite_layer"] == "" for s in steps)


def test_training_run_overflow_attribution_and_census_off(tmp_path):
    huge = {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}}
    metrics, out = run(tmp_path, "fp16-huge", huge, census_every=5)
    assert metrics["first_overflow_step"] == 0 and metrics["first_nonfinite_layer"] == "fc"
    assert [s["first_nonfinite_layer"] for s in read_csv(out / "steps.csv")] == ["fc"] * 3

    metrics, out = run(tmp_path, "fp16-static128", census_every=0)
    # census off: the files exist (a run's outputs never depend on its settings) but hold no rows
    assert (out / "census.csv").read_text().count("\n") == 1 and (out / "grad_hist.csv").read_text().count("\n") == 1
    assert metrics["census_steps"] == 0 and metrics["first_nonfinite_layer"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_run_on_cuda_census_and_attribution(tmp_path):
    """CUDA autocast FP16: the census counts FP16 activation gradients, attribution names the head."""
    metrics, out = run(tmp_path, "fp16-static128", census_every=1, model="vit", device="cuda")
    assert metrics["device"] == "cuda" and metrics["fp16_path"] == "cuda-native"
    rows = check_census_files(out, {0, 1, 2}, {128.0}, 128.0)
    assert any(r["layer"] == "blocks.0.attn.qkv" for r in rows)
    huge = {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}}
    metrics, out = run(tmp_path, "fp16-huge", huge, census_every=5, device="cuda")
    assert metrics["first_overflow_step"] == 0 and metrics["first_nonfinite_layer"] == "fc"


def test_crash_leaves_no_census_file(tmp_path, monkeypatch):
    calls = []
    orig = NumericsMonitor.end_step

    def failing(self, found_inf):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return orig(self, found_inf)
    monkeypatch.setattr(NumericsMonitor, "end_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, "fp32", census_every=1)
    out = tmp_path / "resnet50-fp32"
    assert not (out / "census.csv").exists() and not (out / "grad_hist.csv").exists()


def test_census_every_is_validated():
    study = tiny_study()
    assert resolve_run(validate_study(study), "vit", "fp32", 0).train.census_every == \
        numerics_default()
    study["train"]["census_every"] = -1
    with pytest.raises(ConfigError, match="census_every"):
        validate_study(study)


def numerics_default():
    from lab.config import TRAIN_DEFAULTS
    return TRAIN_DEFAULTS["census_every"]

"""lab.numerics.census: the FP16 census and log2 histograms (the training-loop monitor: test_monitor.py)."""
import math

import numpy as np
import pytest
import torch

import lab.numerics.census as numerics
from lab.numerics.census import Census, Tally, census, log2_histogram

from conftest import SyncCounter

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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_tally_never_syncs_until_result(deterministic):
    parts = [torch.randn(1000, device="cuda") * 1e-6 for _ in range(20)] + \
        [torch.randn(50, device="cuda").half() for _ in range(5)]
    try:
        torch.use_deterministic_algorithms(deterministic)
        Tally(scales=SCALES, hist=(-40, 20)).add(0, parts)  # thresholds cached (host work, once)
        tally = Tally(scales=SCALES, hist=(-40, 20))
        was = torch.cuda.get_sync_debug_mode()  # "warn" in benchmarks/gpu/gpu_check.sh (LAB_CUDA_SYNC_DEBUG)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
        try:
            for i, p in enumerate(parts):
                tally.add(i % 3, p)
        finally:
            torch.cuda.set_sync_debug_mode(was)
        res = tally.result()
    finally:
        torch.use_deterministic_algorithms(False)
    for key in range(3):
        cpu = [p.cpu() for i, p in enumerate(parts) if i % 3 == key]
        assert res[key].census(128.0) == census(cpu, scale=128.0)


def test_fp16_bounds_are_the_same_from_numpys_finfo_and_torchs_and_are_what_a_cast_does():
    """The report draws FP16's lines from numpy's finfo (no torch to import); the census, replay and policies use
    torch.finfo's (lab.core.fp16): one formula (lab.core.fp16_range), the same numbers, and each bound is where an
    FP32 -> FP16 cast changes what it gives (checked with torch's own cast, one FP32 ulp either side)."""
    import numpy as np

    from lab.core import fp16
    from lab.core.fp16_range import bounds
    from lab.report.derived import fp16_limits
    ours, theirs = bounds(np.finfo(np.float16)), bounds(torch.finfo(torch.float16))
    assert ours == theirs
    assert (fp16.MAX, fp16.SMALLEST_SUBNORMAL, fp16.UNDERFLOW_BOUND, fp16.NORMAL_BOUND, fp16.OVERFLOW_BOUND) == \
        tuple(theirs[k] for k in ("MAX", "SMALLEST_SUBNORMAL", "UNDERFLOW_BOUND", "NORMAL_BOUND", "OVERFLOW_BOUND"))
    limits = fp16_limits()
    assert (limits["smallest_subnormal"], limits["smallest_normal"], limits["max"]) == (2.0 ** -24, 2.0 ** -14, 65504)
    assert (limits["underflow_bound"], limits["overflow_bound"]) == \
        (theirs["UNDERFLOW_BOUND"], theirs["OVERFLOW_BOUND"])

    def cast(v):
        return torch.tensor(v, dtype=torch.float32).half().item()

    def below(v):
        return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(0.0)).item()

    def above(v):
        return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(math.inf)).item()
    assert cast(theirs["UNDERFLOW_BOUND"]) == 0 and cast(above(theirs["UNDERFLOW_BOUND"])) > 0
    assert cast(theirs["OVERFLOW_BOUND"]) == math.inf and cast(below(theirs["OVERFLOW_BOUND"])) == 65504
    assert cast(theirs["NORMAL_BOUND"]) == 2.0 ** -14 and cast(below(theirs["NORMAL_BOUND"])) < 2.0 ** -14

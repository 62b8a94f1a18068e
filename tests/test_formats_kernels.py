"""The fused (compiled) quantizer kernels give the eager steps' bits, and a kernel that does not is caught.

lab/formats/kernels.py admits a compiled kernel per constants and shape only where it reproduces the eager steps on
probes of the formats' edge cases; these tests check the admitted kernels on other operands (random magnitudes
across FP32's range, edge blocks, NaN and inf), and that a wrong kernel is refused (runs eager, warns)."""
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from lab.formats import kernels, mx, nvfp4
from lab.formats.kernels import edge_operands, fused, same_bits


@pytest.fixture
def compiled():
    """The kernels on for one test (the suite runs them eager: tests/conftest.py), the compiler's state restored."""
    saved = dict(kernels._state)
    kernels.use_compiled(True)
    yield
    kernels._state.update(saved)


def _operands(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-120, 120, (rows, 1), generator=g).float())
    x[:8] = edge_operands(8, k)[0][:8].roll(seed, dims=1)  # edge rows, shifted off the probe's positions
    bad = x.clone()
    bad[rows - 1, k // 2], bad[rows - 2, 3] = float("nan"), float("-inf")
    return [x, bad]


def _both(fn, *args):
    """fn's eager steps and, with the kernels on, what the kernel computes (compiled where admitted)."""
    kernels.use_compiled(False)
    eager = fn(*args)
    kernels.use_compiled(True)
    return eager, fn(*args)


@pytest.mark.parametrize("element,rounding", [("e4m3", "floor"), ("e4m3", "rceil"), ("e5m2", "ceil"),
                                              ("e2m1", "floor")])
def test_compiled_mx_kernel_is_torchaos_eager_to_mx_bit_for_bit(compiled, element, rounding):
    for shape, seed in (((96, 256), 1), ((64, 96), 2)):
        for x in _operands(*shape, seed):
            eager, got = _both(mx._quantize, x, 1, element, rounding)
            assert same_bits(eager, got), (element, rounding, shape)
    admitted = [ok for key, ok in mx._to_mx.admitted.items() if key[1] == mx._elem_dtype(element)]
    if not any(admitted):
        pytest.skip(f"the compiled MX kernel {element}/{rounding} is not admitted on this machine (runs eager)")


@pytest.mark.parametrize("two_d,stochastic", [(False, False), (True, True)])
def test_compiled_nvfp4_kernel_is_the_eager_quantizer_bit_for_bit(compiled, two_d, stochastic):
    for shape, seed in (((64, 128), 3), ((32, 48), 4)):
        for x in _operands(*shape, seed):
            eager, got = _both(lambda t: nvfp4.quantize_nvfp4(t, 1, two_d, stochastic,
                                                              torch.Generator().manual_seed(seed)).values, x)
            assert same_bits(eager, got), (two_d, stochastic, shape)


@pytest.mark.parametrize("mode", ["fast", "promote"])
def test_compiled_accumulator_model_is_the_eager_model_bit_for_bit(compiled, mode):
    """Hopper's accumulator model (lab/formats/accumulate.py) fused: the same outputs as its eager steps on operands
    other than its probe's, in its FP32 path (E4M3 values times powers of two, magnitudes spread along k) and its
    FP64 path (a tensor scale that is not a power of two), with growing all-positive sums, zero rows and columns
    and a transposed (strided) weight; k of 3 MMA steps (a promotion after 2)."""
    from lab.formats import accumulate

    g = torch.Generator().manual_seed(11)

    def e4m3(x):
        return (x * (448.0 / x.abs().amax())).to(torch.float8_e4m3fn).float()
    a = e4m3(torch.randn(40, 96, generator=g)) * torch.exp2(torch.randint(-14, 10, (40, 96), generator=g).float())
    w = e4m3(torch.randn(24, 96, generator=g)) * torch.exp2(torch.randint(-10, 1, (24, 96), generator=g).float())
    a[3], w[5] = 0.0, 0.0
    cases = [(a, w.t()), (a.abs(), w.abs().t().contiguous()), (a * 0.3071, w.t() * 1.7713)]
    assert accumulate._fp32_exact(a) and not accumulate._fp32_exact(cases[2][0])
    for x, y in cases:
        eager, got = _both(accumulate.gemm, x, y, mode, 64)
        assert same_bits(eager, got), mode
    # floors that lift a's and b's smaller elements (FP8 subnormals at their format's smallest normal exponent)
    eager, got = _both(lambda x, y: accumulate.gemm(x, y, mode, 64, a_floor=-4, b_floor=-8), *cases[0])
    assert same_bits(eager, got), mode
    # both paths ran compiled (this test's keys: a's shape and the mode; other tests' kernels stay in the process)
    dtypes = {key[0][2] for key, ok in accumulate._model.admitted.items() if ok and key[0][0] == (40, 96)
              and key[4] == mode}  # (a, b, ea, eb, accumulate, ...)
    assert dtypes == {torch.float32, torch.float64}


@pytest.mark.parametrize("recipe", ["fp8-blockwise", {"name": "mxfp8", "rounding": "rceil"}, "nvfp4"])
def test_the_fused_census_counts_are_the_eager_census_bit_for_bit(compiled, recipe):
    """The FP8 census's numbers of each operand of a recipe's GEMMs (lab/fp8/census.py: its counts and extrema run
    fused once hot), in both orientations (a GEMM's k along either dimension, a transposed view) and with NaN and
    inf: the same bits compiled as eager."""
    from lab.fp8 import create_recipe
    from lab.fp8.census import _exact_numbers_fused, operand_stats
    from lab.formats import quantize
    r = create_recipe(recipe)
    for x in _operands(64, 128, 5):
        for fmt in {f for gemm in (r.forward, r.grad_input, r.grad_weight) for f in (gemm.a, gemm.b) if f}:
            for t, k_dim in ((x, 1), (x, 0), (x.t(), 1)):
                q = quantize(t, fmt, k_dim, stats=True, generator=torch.Generator().manual_seed(2))
                eager, got = _both(operand_stats, t, q, fmt, k_dim)
                assert same_bits(eager, got), (fmt, k_dim, t.stride())
    # every key ran compiled: counts and maxima are exact, so any correct compilation gives the eager bits
    assert _exact_numbers_fused.admitted and all(_exact_numbers_fused.admitted.values())


def test_a_kernel_that_compiles_to_other_bits_is_refused_and_runs_eager(compiled):
    def probe(x, offset):
        return [(t, offset) for t in edge_operands(*x.shape)]

    @fused(probe)
    def shifted(x, offset):  # compiled, it adds a different number: what a mis-compilation looks like
        return x + (offset * 2 if kernels.fusing() else offset)

    x = torch.ones(16, 32)
    with pytest.warns(RuntimeWarning, match="other bits than eager"):
        got = shifted(x, 1.0)
    assert torch.equal(got, x + 1.0)  # eager's
    assert list(shifted.admitted.values()) == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused once: no second warning, still eager
        assert torch.equal(shifted(x, 1.0), x + 1.0)


def test_a_compiler_failure_warns_and_the_process_goes_on_eager():
    """A machine without a C++ compiler (inductor pointed at a missing one, its caches off), in a process of its own:
    inductor remembers the compiler it found."""
    script = textwrap.dedent("""
        import warnings
        import torch
        import torch._inductor.config as inductor
        from lab.formats import kernels
        from lab.formats.kernels import fused
        inductor.cpp.cxx = ("/nonexistent/c++",)
        inductor.force_disable_caches = True
        kernels.use_compiled(True)

        @fused(lambda x: [(x,)])
        def doubled(x):
            return x * 2 + 1

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = doubled(torch.ones(4, 16))
        assert torch.equal(out, torch.full((4, 16), 3.0))
        assert any("compiled quantizer kernels failed" in str(w.message) for w in caught), caught
        assert not kernels.compiled_in_use() and kernels.provenance()["compiler_failure"]
        print("ok")
    """)
    env = dict(os.environ, LAB_COMPILED_QUANTIZERS="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_same_bits_tells_signed_zeros_apart_and_takes_any_nan_for_any_nan():
    nan = torch.tensor([float("nan")])
    assert same_bits(nan, -nan) and same_bits((nan, torch.zeros(2)), (nan.abs(), torch.zeros(2)))
    assert not same_bits(torch.zeros(1), -torch.zeros(1))
    assert not same_bits(torch.ones(2), torch.ones(2).nextafter(torch.full((2,), 2.0)))


def test_edge_operands_keep_their_blocks_in_any_shape_and_the_callers_random_state():
    state = torch.get_rng_state()
    finite, bad = edge_operands(8, 48)
    assert torch.equal(torch.get_rng_state(), state)
    assert finite.isfinite().all() and bad.isnan().any() and bad.isinf().any()
    assert (finite[0, :32] == 0).all()  # the all-zero block
    with pytest.raises(ValueError, match="multiple of 16"):
        edge_operands(8, 40)


@pytest.mark.parametrize("recipe", [{"name": "mxfp8", "rounding": "rceil"}, {"name": "nvfp4"},
                                    {"name": "fp8-current", "accumulate": "fast"}])
def test_a_recipe_trains_the_same_bits_with_the_kernels_compiled(compiled, recipe):
    """Three training steps of a small GPT under the recipe (BF16 autocast, the lab's contract, AdamW): the loss
    and every parameter bit for bit the same with the fused kernels as eager (NVFP4: stochastic rounding's draws,
    the Hadamard transform and 2-D weights included)."""
    from lab.fp8 import create_recipe
    from lab.fp8.linear import convert
    from lab.models.gpt import GPT, GPTConfig
    from lab.numerics.precision import autocast_for

    def train(on: bool):
        kernels.use_compiled(on)
        torch.manual_seed(0)
        model = convert(GPT(GPTConfig(vocab_size=128, context=32, n_layer=1, d_model=64, n_head=2)),
                        create_recipe(recipe))
        g = torch.Generator().manual_seed(5)
        for layer in model.modules():
            if hasattr(layer, "generator"):
                layer.generator = g
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            with autocast_for("bf16", "cpu"):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    (eager_loss, eager_params), (loss, params) = train(False), train(True)
    assert same_bits(eager_loss, loss) and same_bits(tuple(eager_params), tuple(params))
    from lab.formats import accumulate
    fn = {"mxfp8": mx._to_mx, "nvfp4": nvfp4._nvfp4, "fp8-current": accumulate._model}[recipe["name"]]
    assert any(fn.admitted.values())  # the kernels did run compiled


def test_a_kernel_is_compiled_only_once_it_is_hot(monkeypatch):
    """By default a kernel runs eager for its first COMPILE_AFTER calls (a short run would lose more to compiling
    than it gains), then compiled; the count is per constants and shape."""
    saved = dict(kernels._state)
    kernels.use_compiled(True, after=3)
    try:
        def probe(x):
            return [(t,) for t in edge_operands(*x.shape)]

        @fused(probe)
        def doubled(x):
            return x * 2

        x = torch.ones(16, 32)
        for _ in range(3):
            doubled(x)
        assert doubled.admitted == {}  # three calls: eager, nothing compiled
        before = kernels.provenance()["kernels_compiled"]
        doubled(x)
        assert list(doubled.admitted.values()) == [True]
        assert kernels.provenance()["kernels_compiled"] == before + 1  # what the run's provenance.json records
        doubled(torch.ones(32, 32))  # another shape: its own count
        assert len(doubled.admitted) == 1

        @fused(probe, after=1)  # a kernel that pays sooner: compiled from its own count, the process's notwithstanding
        def tripled(x):
            return x * 3

        tripled(x)
        assert tripled.admitted == {}
        tripled(x)
        assert list(tripled.admitted.values()) == [True]
    finally:
        kernels._state.update(saved)

"""The block-scaled quantizers of lab.formats (MX, NVFP4, stochastic rounding, the random Hadamard transform): bit for
bit against torchao where the lab runs torchao's, and against the FP64 references of lab.formats.reference (written
from the specifications) everywhere, with the departures each module documents tested as documented."""
import warnings

import pytest
import torch

from lab.formats import OperandFormat, max_of, quantize
from lab.formats.hadamard import hadamard_matrix, hadamard_signs, random_hadamard
from lab.formats.mx import mx_parts, quantize_mx
from lab.formats.nvfp4 import own_parts, quantize_nvfp4, round_e2m1
from lab.formats.reference import SPEC, _block_amax, mx_exponent, ref_cast, ref_mx, ref_nvfp4
from lab.formats.rounding import neighbours, stochastic_round

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

ELEMENTS = ("e4m3", "e5m2", "e2m1")
ROUNDINGS = ("floor", "ceil", "rceil", "even")
TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
TIE = 2.0 ** -20  # relative distance to a rounding tie within which FP32 and FP64 arithmetic may part


def counts(q, x) -> tuple[int, int]:
    """A stats quantization's saturated (its clipped mask) and flushed (non-zero in x, zero in its values) counts,
    as the FP8 census counts them (lab/fp8/census.py)."""
    return int(q.clipped.sum()), int(((x != 0) & (q.values == 0)).sum())


def blocky(seed, rows, cols, block, binades):
    """Normal values, each 1 x block run scaled by its own power of two in [-binades, binades), with an all-zero row,
    an all-zero block, an outlier block (one huge value among small ones) and a block of exact grid values."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(-binades, binades, (rows, cols // block), generator=g).float()
    x = torch.randn(rows, cols, generator=g) * torch.exp2(offsets).repeat_interleave(block, 1)
    x[0] = 0
    x[1, :block] = 0
    x[2, block:2 * block] = torch.randn(block, generator=g) * 1e-3
    x[2, block + 3] = 1e3
    x[3, :block] = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0] * (block // 8))
    return x


def orient(x, k_dim):
    """x with its k (last) dimension moved to k_dim, contiguous: the quantizers see both layouts."""
    return x if k_dim == 1 else x.t().contiguous()


def same(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=0, equal_nan=True)


def near_tie(v, element):
    """Where v (FP64) lies within TIE of a round-to-nearest tie of `element` (a midpoint of two grid values)."""
    top = max_of(element)
    mag = v.abs()
    lo, hi = neighbours(torch.where(mag < top, mag, torch.zeros_like(mag)), element)
    return (mag < top) & ((mag - (lo + hi) / 2).abs() <= TIE * mag)


# ---- MX ----

@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("k_dim", [0, 1])
def test_mx_bit_exact_against_torchao_and_reference(element, rounding, k_dim):
    x = orient(blocky(1, 48, 256, 32, 60), k_dim)
    q = quantize_mx(x, k_dim, element, rounding, stats=True)
    # torchao called directly, k last
    scale, data = to_mx(x.movedim(k_dim, -1).contiguous(), TORCH_DTYPE[element], 32,
                        getattr(ScaleCalculationMode, rounding.upper()))
    same(q.values, to_dtype(data, scale, TORCH_DTYPE[element], 32, torch.float32).movedim(-1, k_dim))
    ref = ref_mx(x.double(), k_dim, element, rounding)
    same(q.values, ref.values)
    assert counts(q, x) == (ref.saturated, ref.flushed)
    assert q.values.dtype == torch.float32 and q.values.shape == x.shape


def test_mx_saturation_and_flush_are_counted():
    """The data clips under floor (amax above the element max times the scale) and flushes in E2M1: the counts the
    equality above compares are not all zero."""
    x = blocky(2, 48, 256, 32, 60)
    floor = quantize_mx(x, 1, "e2m1", "floor", stats=True)
    assert min(counts(floor, x)) > 0
    assert counts(quantize_mx(x, 1, "e4m3", "rceil", stats=True), x)[0] == 0  # rceil's point: nothing clips


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_rceil_log2_edge(element):
    """amax one FP32 step above max * 2^p: the spec's scale is 2^(p+1); torchao's FP32 log2 may round to p (machine
    dependent), which the lab documents: then that scale is exactly half the spec's, and the amax element, one FP32
    step above the element's max, rounds to max: nothing lost to the range, so not counted as saturated."""
    top = max_of(element)
    x = torch.zeros(24, 32)
    for i, p in enumerate(range(-100, 100, 9)):
        x[i, 0] = torch.nextafter(torch.tensor(top * 2.0 ** p), torch.tensor(float("inf")))
        x[i, 1:] = x[i, 0] / 3
    _, scales = mx_parts(x, 1, element, "rceil")
    spec = torch.exp2(mx_exponent(x.double().abs().amax(1, keepdim=True), element, "rceil"))
    lab = scales.double()[:, :1]
    assert ((lab == spec) | (lab == spec / 2)).all()
    ref = ref_mx(x.double(), 1, element, "rceil")
    q = quantize_mx(x, 1, element, "rceil", stats=True)
    assert ref.saturated == 0 and counts(q, x)[0] == 0


@pytest.mark.parametrize("element", ELEMENTS)
def test_reference_rceil_is_its_definition(element):
    """The reference's rceil exponent p is the smallest with amax / 2^p <= max, FP64 rounding edges included."""
    top = torch.tensor(max_of(element), dtype=torch.float64)
    edges = top * torch.exp2(torch.arange(-100.0, 100.0, 7, dtype=torch.float64))
    amax = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges / 2),
                      torch.rand(64, dtype=torch.float64) * 1e6])
    p = mx_exponent(amax, element, "rceil")
    assert (amax / torch.exp2(p) <= top).all() and (amax / torch.exp2(p - 1) > top).all()


def test_mx_tiny_blocks_depart_as_documented():
    """Blocks with amax near 2^-125: floor's E8M0 scale is 2^-127, which torchao divides by as 2^-126 and multiplies
    back by as 2^-127 (values halved); rceil's scales by 1 instead of 2^127 (the block flushes)."""
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)) * 2.0 ** -125
    ref = ref_mx(x.double(), 1, "e4m3", "floor")
    assert (ref.scales == 2.0 ** -127).all() and (ref.values != 0).any()
    same(quantize_mx(x, 1, "e4m3", "floor").values, ref.values / 2)
    assert (quantize_mx(x, 1, "e4m3", "rceil").values == 0).all()


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_mx_nan_and_inf_as_documented(rounding):
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(4))
    x[0, 5] = float("nan")
    x[0, 40] = float("inf")
    v = quantize_mx(x, 1, "e4m3", rounding).values
    assert torch.isnan(v[0, :32]).all()  # the NaN's block: all NaN
    assert v[0, 40] == float("inf") and (v[0, 32:64].nan_to_num(posinf=0) == 0).all()  # inf's block: inf, zeros
    same(v[0, 64:], ref_mx(x[:, 64:].double(), 1, "e4m3", rounding).values[0])  # the others untouched


def test_mx_rejects_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mx(torch.randn(4, 48), 1)
    with pytest.raises(ValueError, match="rounding"):
        quantize_mx(torch.randn(4, 64), 1, scale_rounding="nearest")


# ---- NVFP4 ----

def torchao_parts(xk):
    """torchao's NVFP4 of xk (FP32, k last, 1x16 blocks, round to nearest) as own_parts returns it: elements, each
    element's block scale, per_tensor_scale."""
    t = NVFP4Tensor.to_nvfp4(xk, per_tensor_scale=per_tensor_amax_to_scale(xk.abs().amax()))
    elements = f4_unpacked_to_f32(unpack_uint4(t.qdata.view(torch.uint8))).reshape(xk.shape)
    return elements, t.scale.to(torch.float32).repeat_interleave(16, dim=-1), t.per_tensor_scale


def test_round_e2m1_is_torchaos_cast():
    """The lab's arithmetic E2M1 rounding against torchao's bit-field cast: every tie and its FP32 neighbours,
    binade edges, zeros of both signs, subnormal FP32 and random values within +-6, bit for bit. NaN stays NaN
    (torchao's cast makes it +-1.5; a NaN there means a NaN scale, so the values are NaN either way)."""
    pts = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    marks = torch.cat([pts, (pts[1:] + pts[:-1]) / 2, torch.tensor([1e-45, 1e-39, 2.0 ** -126, 0.25])])
    near = torch.cat([marks, torch.nextafter(marks, marks + 1), torch.nextafter(marks, marks - 1).clamp(min=0)])
    x = torch.cat([near, -near, torch.tensor([-0.0]),
                   (torch.rand(100_000, generator=torch.Generator().manual_seed(13)) * 12 - 6)]).clamp(-6, 6)
    assert torch.equal(round_e2m1(x).view(torch.int32), f4_unpacked_to_f32(f32_to_f4_unpacked(x)).view(torch.int32))
    assert torch.isnan(round_e2m1(torch.tensor([float("nan")]))).all()

@pytest.mark.parametrize("k_dim", [0, 1])
def test_nvfp4_1x16_bit_exact_against_torchao(k_dim):
    x = orient(blocky(5, 64, 256, 16, 12), k_dim)
    xk = x.movedim(k_dim, -1).contiguous()
    t = NVFP4Tensor.to_nvfp4(xk, per_tensor_scale=per_tensor_amax_to_scale(xk.abs().amax()))
    same(quantize_nvfp4(x, k_dim).values, t.dequantize(torch.float32).movedim(-1, k_dim))
    # the lab's own path (16x16 blocks, stochastic rounding) in 1x16 round-to-nearest mode: torchao's, bit for bit
    for a, b in zip(own_parts(xk), torchao_parts(xk)):
        same(a, b)


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("k_dim", [0, 1])
def test_nvfp4_against_reference(two_d, k_dim):
    """Elements and scales equal the spec's except within FP32 rounding of a tie (FP32 versus FP64 scale
    arithmetic), dequantized values within FP32 rounding; stats as the reference counts them."""
    x = orient(blocky(6, 64, 256, 16, 12), k_dim)
    xk = x.movedim(k_dim, -1).contiguous()
    q = quantize_nvfp4(x, k_dim, two_d=two_d, stats=True)
    elements, scale, pts = own_parts(xk, 16 if two_d else 1)
    ref = ref_nvfp4(x.double(), k_dim, two_d)
    r_el, r_val = ref.elements.movedim(k_dim, -1), ref.values.movedim(k_dim, -1)
    glob = 448.0 * 6 / xk.double().abs().max()
    s64 = (_block_amax(xk.double(), 16 if two_d else 1, 16) / 6 * glob).clamp(2.0 ** -6, 448)
    scaled = xk.double() / ref.scales.movedim(k_dim, -1)
    excused = near_tie(s64, "e4m3") | near_tie(scaled, "e2m1")
    assert excused.double().mean() < 1e-3
    ok = ~excused
    same(elements[ok], r_el[ok])
    same(scale.double()[ok], ref_cast(s64, "e4m3")[ok])
    torch.testing.assert_close(q.values.movedim(k_dim, -1).double()[ok], r_val[ok], rtol=4 * 2.0 ** -24, atol=0)
    # within FP32 rounding of 6, clipped or not is the FP32 arithmetic's call: where it and FP64 part
    s32 = (xk * ((1.0 / pts) / scale)).double()
    slack = int((excused | (((scaled.abs() - 6).abs() <= TIE * 6) & (s32 != scaled))).sum())
    saturated, flushed = counts(q, x)
    assert abs(saturated - ref.saturated) <= slack and abs(flushed - ref.flushed) <= slack
    # an E4M3 block scale rounds the block's amax to at most 6 (1 + 1/16) < 7 (what rounds to 6): NVFP4 never clips
    assert ref.saturated == 0 and saturated == 0 and ref.flushed > 0


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_scale_underflow_clamps_as_documented(two_d):
    """A block ~2^-19 of the tensor's amax: its E4M3 scale underflows. The format's letter zeroes it; the lab, as
    torchao, clamps the scale to 2^-6 and keeps the block non-zero (equal to the clamping reference)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 32, generator=g).clamp(-1, 1)
    x[0, 0] = 1.0  # tensor amax 1: tensor scale 448 * 6
    # block amax 5e-3 / (448 * 6): its E4M3 scale 8.3e-4 rounds to 0 (below 2^-10, half E4M3's smallest 2^-9),
    # while under the clamped 2^-6 its largest elements still round to 0.5 in E2M1
    tile = torch.randn(16, 16, generator=g)
    x[16:, 16:] = tile / tile.abs().amax(1, keepdim=True) * (5e-3 / 2688)
    tiny = (slice(16, 32), slice(16, 32))
    q = quantize_nvfp4(x, 1, two_d=two_d)
    letter = ref_nvfp4(x.double(), 1, two_d, clamp_scale=False)
    clamped = ref_nvfp4(x.double(), 1, two_d, clamp_scale=True)
    assert (letter.values[tiny] == 0).all() and (q.values[tiny] != 0).any()
    torch.testing.assert_close(q.values[tiny].double(), clamped.values[tiny], rtol=4 * 2.0 ** -24, atol=0)


def test_nvfp4_zero_and_nan_tensors():
    z = quantize_nvfp4(torch.zeros(16, 32), 1, stats=True)
    assert (z.values == 0).all() and counts(z, torch.zeros(16, 32)) == (0, 0)
    z2 = quantize_nvfp4(torch.zeros(16, 32), 0, two_d=True)
    assert (z2.values == 0).all()
    assert (quantize_nvfp4(-torch.zeros(16, 32), 1).values.view(torch.int32) == 0).all()  # +0, even from -0
    x = torch.randn(16, 32)
    x[3, 3] = float("nan")
    assert torch.isnan(quantize_nvfp4(x, 1).values).all()
    x[3, 3] = float("inf")
    assert torch.isnan(quantize_nvfp4(x, 0, two_d=True).values).all()
    with pytest.raises(ValueError, match="multiple"):
        quantize_nvfp4(torch.randn(24, 32), 1, two_d=True)


def test_nvfp4_stochastic_picks_a_neighbour_and_is_reproducible():
    x = blocky(8, 32, 64, 16, 6)
    xk = x.contiguous()
    elements, scale, pts = own_parts(xk, 1, stochastic=True, generator=torch.Generator().manual_seed(9))
    rtn_el, rtn_scale, _ = own_parts(xk)
    same(scale, rtn_scale)  # the scales round to nearest either way
    scaled = (xk * ((1.0 / pts) / scale)).clamp(-6, 6).double()
    lo, hi = neighbours(scaled.abs().clamp(max=5.999), "e2m1")
    mag = elements.double().abs()
    assert ((mag == lo) | (mag == hi) | (mag == scaled.abs())).all()
    a = quantize_nvfp4(x, 1, stochastic=True, generator=torch.Generator().manual_seed(9)).values
    b = quantize_nvfp4(x, 1, stochastic=True, generator=torch.Generator().manual_seed(9)).values
    same(a, b)
    assert not torch.equal(elements, rtn_el)


# ---- element casts and stochastic rounding ----

def grid(element):
    """Every non-negative representable value of `element`, enumerated from its specification."""
    mbits, emin, emax, top = SPEC[element]
    vals = [k * 2.0 ** (emin - mbits) for k in range(2 ** mbits)]
    vals += [(1 + j / 2 ** mbits) * 2.0 ** e for e in range(emin, emax + 1) for j in range(2 ** mbits)]
    return torch.tensor(sorted(v for v in vals if v <= top), dtype=torch.float64)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_ref_cast_matches_torch_fp8_casts(element):
    pts = grid(element)
    mids = ((pts[1:] + pts[:-1]) / 2).float()  # every tie: to even
    x = torch.cat([torch.randn(4096) * torch.exp2(torch.randint(-24, 18, (4096,)).float()), mids, -mids])
    top = max_of(element)
    same(ref_cast(x.double(), element), x.clamp(-top, top).to(TORCH_DTYPE[element]).double())


def test_integer_draws_are_the_uniform_draws_bit_for_bit():
    """NVFP4's kernel takes its draws as generator words, two to an int64 (rounding.uniform_words), unpacks them and
    scales them by 2^-24 itself: the same numbers as torch.rand's from the same generator state, which is left where
    torch.rand leaves it."""
    from lab.formats.rounding import DRAW_BITS, draws_from_words, uniform_draws, uniform_words
    for shape in ((7, 34), (64, 128)):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        u, words = uniform_draws(torch.empty(shape), g1), uniform_words(torch.empty(shape), g2)
        k = draws_from_words(words, shape)
        assert words.dtype == torch.int64 and words.numel() * 2 == u.numel()
        assert k.dtype == torch.int32 and 0 <= int(k.min()) and int(k.max()) < 2 ** DRAW_BITS
        same(k.double() * 2.0 ** -DRAW_BITS, u.double())
        assert torch.equal(g1.get_state(), g2.get_state())
    with pytest.raises(ValueError, match="even number"):
        uniform_words(torch.empty(7, 33), None)


@pytest.mark.parametrize("element", ELEMENTS)
def test_stochastic_round_unbiased_neighbours_exact(element):
    g = torch.Generator().manual_seed(10)
    top, pts = max_of(element), grid(element)
    x = torch.cat([torch.rand(150, generator=g, dtype=torch.float64) * top,
                   torch.exp2(-torch.rand(50, generator=g, dtype=torch.float64) * 12) * top])
    x = x * torch.where(torch.rand(200, generator=g) < 0.5, -1.0, 1.0).double()
    idx = torch.searchsorted(pts, x.abs(), right=True).clamp(max=len(pts) - 1)
    lo, hi = pts[idx - 1], pts[idx]
    draws = stochastic_round(x.expand(4000, -1), element, g)
    assert ((draws.abs() == lo) | (draws.abs() == hi)).all()
    p = (x.abs() - lo) / (hi - lo)
    se = (p * (1 - p)).sqrt() * (hi - lo) / 4000 ** 0.5
    assert ((draws.mean(0) - x).abs() <= 6 * se + 1e-12 * x.abs()).all()
    exact = torch.cat([pts, -pts])
    same(stochastic_round(exact, element, g), exact)
    big = torch.tensor([top * 1.5, -top * 3, float("inf")], dtype=torch.float64)
    same(stochastic_round(big, element, g), torch.tensor([top, -top, top], dtype=torch.float64))


# ---- random Hadamard transform ----

def test_hadamard_is_orthogonal_and_keeps_the_product():
    g = torch.Generator().manual_seed(11)
    signs = hadamard_signs(16, g)
    assert set(signs.tolist()) <= {-1.0, 1.0}
    q = signs.double().unsqueeze(1) * hadamard_matrix(16, torch.float64) / 4
    torch.testing.assert_close(q @ q.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-15)
    a = torch.randn(8, 64, generator=g, dtype=torch.float64)
    b = torch.randn(64, 12, generator=g, dtype=torch.float64)
    ha, hb = random_hadamard(a, 1, signs), random_hadamard(b, 0, signs)
    assert not torch.allclose(ha, a)
    torch.testing.assert_close(ha @ hb, a @ b, rtol=1e-13, atol=1e-13)
    same(random_hadamard(a.T.contiguous(), 0, signs), ha.T)  # k_dim picks the axis, not the layout
    same(random_hadamard(torch.eye(16, dtype=torch.float64), 1, signs), q)  # the documented Q = diag(s) H16 / 4
    same(hadamard_signs(16, torch.Generator().manual_seed(5)), hadamard_signs(16, torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard(torch.randn(4, 24), 1, signs)


# ---- FP8 tiles and blocks ----

@pytest.mark.parametrize("granularity", ["tile", "block"])
@pytest.mark.parametrize("shape", [(64, 192), (96, 160), (160, 288), (256, 64)])
@pytest.mark.parametrize("k_dim", [0, 1])
def test_fp8_tiles_and_blocks_are_per_tensor_quantizations_of_each(granularity, shape, k_dim):
    """A 1x128 tile or 128x128 block quantizes as the tensor its values make up would (short tiles at the edges
    included), stats summed over them: the per-tile scales broadcast over a blocked view of x (lab.formats.scaled)."""
    x = blocky(12, *shape, 16, 12)
    x[5, :] = 3e4  # a row far above the rest: the tiles it lies in take another scale
    fmt = OperandFormat("e4m3", granularity)
    q = quantize(x, fmt, k_dim, stats=True)
    want, saturated, flushed = torch.empty_like(x), 0, 0
    rows, cols = (1, 128) if granularity == "tile" else (128, 128)
    if granularity == "tile" and k_dim == 0:
        rows, cols = cols, rows
    for r in range(0, shape[0], rows):
        for c in range(0, shape[1], cols):
            t = quantize(x[r:r + rows, c:c + cols], OperandFormat("e4m3", "tensor"), k_dim, stats=True)
            want[r:r + rows, c:c + cols] = t.values
            t_saturated, t_flushed = counts(t, x[r:r + rows, c:c + cols])
            saturated, flushed = saturated + t_saturated, flushed + t_flushed
    same(q.values, want)
    assert counts(q, x) == (saturated, flushed)


@pytest.mark.parametrize("fmt", [OperandFormat("e4m3", g) for g in ("tensor", "row", "tile", "block")]
                         + [OperandFormat("e5m2", "tile"), OperandFormat("e4m3", "row", "pow2"),
                            OperandFormat("e4m3", "tensor", "delayed")], ids=lambda f: f"{f.granularity}-{f.scale}")
@pytest.mark.parametrize("k_dim", [0, 1])
def test_fp8_quantization_of_a_transposed_view_is_the_same_bits(fmt, k_dim):
    """w^T and go^T reach the quantizer as transposed views, which it quantizes as their contiguous transposes
    along the other dimension (strided tiles cost ~3x): the same values, elements, clipped mask and counts as the
    same tensor laid out contiguously."""
    x = blocky(13, 160, 288, 16, 12)
    x[5, :] = 3e4
    view = x.t().contiguous().t()
    assert not view.is_contiguous() and torch.equal(view, x)
    history = torch.tensor(100.0)
    a = quantize(x, fmt, k_dim, history_amax=history, stats=True)
    b = quantize(view, fmt, k_dim, history_amax=history, stats=True)
    for field in ("values", "elements", "clipped"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert counts(a, x) == counts(b, view)

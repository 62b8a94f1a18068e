"""lab.formats.accumulate: FP32 accumulation is torch.mm bit for bit; the Hopper model's properties, from its definition
(aligned addends and sums cut toward zero to FRAC_BITS fraction bits, GROUP products a step), not from pinned numbers."""
import math

import pytest
import torch

from lab.formats import accumulate
from lab.formats.accumulate import FRAC_BITS, GROUP, PROMOTE_EVERY, gemm

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def e4m3(x):
    return (x * (E4M3_MAX / x.abs().max())).to(torch.float8_e4m3fn).float()


def operands(m, k, n, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    return (e4m3(a.abs()), e4m3(b.abs())) if positive else (e4m3(a), e4m3(b))


def test_fp32_is_torch_mm_bit_for_bit():
    for a, b in (operands(17, 300, 23, 0), (torch.randn(8, 1000), torch.randn(1000, 5))):  # FP8 values or not
        c = gemm(a, b, "fp32")
        assert c.dtype == torch.float32 and torch.equal(c, torch.mm(a, b))  # gemm's fp32 is this call: one kernel


def test_small_integer_sums_are_exact_in_every_mode():
    # |every partial sum| <= K * 4 * 4 < 2^(FRAC_BITS + 1): integers on the accumulator's grid, nothing to cut
    k = 2 ** (FRAC_BITS + 1) // 16 // 2
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-4, 5, (12, k), generator=g).float()
    b = torch.randint(-4, 5, (k, 9), generator=g).float()
    exact = a.double() @ b.double()
    for mode in accumulate.MODES:
        assert torch.equal(gemm(a, b, mode).double(), exact), mode


def test_fast_error_grows_with_k_for_growing_sums_and_exceeds_promote():
    rel = {}
    for k in (256, 1024, 4096):
        a, b = operands(16, k, 16, 2, positive=True)
        exact = a.double() @ b.double()
        for mode in ("fast", "promote"):
            c = gemm(a, b, mode).double()
            rel[mode, k] = ((exact - c).abs() / exact).max().item()
            if mode == "fast":  # positive addends cut toward zero: no partial sum ever exceeds the exact one
                assert (c <= exact).all()
    assert 0 < rel["fast", 256] < rel["fast", 1024] < rel["fast", 4096]
    assert rel["fast", 4096] > rel["promote", 4096]


def test_promote_every_at_least_k_is_fast():
    a, b = operands(10, 200, 7, 3)
    fast = gemm(a, b, "fast")
    for every in (GROUP * ((200 + GROUP - 1) // GROUP), 4 * 256):
        assert torch.equal(gemm(a, b, "promote", promote_every=every), fast)
    assert not torch.equal(gemm(a, b, "promote", promote_every=GROUP), fast)  # promotion does change the sum


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cut_is_toward_zero(sign):
    ulp = 2.0 ** -FRAC_BITS
    # alignment: 1 + 0.75 ulp; to nearest it would be 1 + ulp, toward zero (either sign) it is 1
    a = torch.tensor([[sign, sign * 1.5]])
    b = torch.tensor([[1.0], [0.5 * ulp]])
    assert gemm(a, b, "fast").item() == sign
    assert gemm(a, b, "fp32").item() == sign * (1 + 0.75 * ulp)  # FP32 keeps it: the cut is the model's
    # normalisation: three addends of leading bit 2^0 carry into 2^2, whose grid is 4 ulp; 4 + 3 ulp -> 4
    a = torch.tensor([[sign * 1.75, sign * 1.25, sign * (1 + 3 * ulp)]])
    b = torch.ones(3, 1)
    assert gemm(a, b, "fast").item() == sign * 4.0
    assert gemm(a, b, "fast", frac_bits=FRAC_BITS + 2).item() == sign * (4 + 3 * ulp)  # room for the bits: kept


def test_products_are_aligned_to_the_running_sum():
    # a step's products below the running sum's last place are cut one by one, even where together they would count:
    # S = 1 after the first step, then GROUP products of 0.75 ulp each (24 ulp together at GROUP = 32) are all lost
    ulp = 2.0 ** -FRAC_BITS
    a = torch.cat([torch.tensor([1.0]), torch.zeros(GROUP - 1), torch.full((GROUP,), 0.75 * ulp)])[None]
    b = torch.ones(2 * GROUP, 1)
    assert gemm(a, b, "fast").item() == 1.0
    assert gemm(a, b, "fp32").item() == 1.0 + GROUP * 0.75 * ulp


def test_the_accumulator_holds_frac_bits_plus_one_significant_bits():
    a, b = operands(8, 512, 8, 4)
    c = gemm(a, b, "fast").double()
    _, e = torch.frexp(c)  # c = m 2^e, 0.5 <= |m| < 1: c 2^(FRAC_BITS + 1 - e) must be an integer
    scaled = torch.ldexp(c, FRAC_BITS + 1 - e)
    assert torch.equal(scaled, scaled.trunc())


def test_bad_arguments():
    a, b = torch.ones(2, 64), torch.ones(64, 2)
    with pytest.raises(ValueError):
        gemm(a, b, "bf16")
    with pytest.raises(ValueError):
        gemm(a, b, "promote", promote_every=GROUP + 1)
    with pytest.raises(ValueError):
        gemm(a.double(), b.double(), "fast")


def test_the_fp32_shortcut_changes_nothing(monkeypatch):
    # E4M3 operands take the FP32 path (exact products); forcing FP64 must give the same bits, tiny and zero
    # entries included (all-zero steps, sums far below the products)
    a, b = operands(9, 300, 11, 5)
    a[:, :64] = 0  # two all-zero steps first
    a[0] *= 2.0 ** -30
    ab = [(mode, gemm(a, b, mode)) for mode in ("fast", "promote")]
    assert accumulate._fp32_exact(a) and accumulate._fp32_exact(b)
    monkeypatch.setattr(accumulate, "_fp32_exact", lambda x: False)
    for mode, c in ab:
        assert torch.equal(gemm(a, b, mode), c), mode


def test_rows_in_chunks_change_nothing(monkeypatch):
    # gemm works through the rows in cache-sized chunks; every output row is its own sum, so a chunk of one row and a
    # chunk of all rows give the same bits (a chunk boundary falling mid-matrix is what is exercised)
    a, b = operands(37, 256, 13, 8)
    whole = {mode: gemm(a, b, mode) for mode in ("fast", "promote")}
    monkeypatch.setattr(accumulate, "CHUNK_ELEMENTS", 1)  # max(8, ...): chunks of 8 rows, the last one of 5
    for mode, c in whole.items():
        assert torch.equal(gemm(a, b, mode), c), mode
        assert torch.equal(torch.cat([gemm(a[i:i + 1], b, mode) for i in range(a.shape[0])]), c), mode


def test_non_finite_operands_give_nan_where_they_reach_and_leave_the_rest():
    # the model sums integers (no NaN among them): a NaN or inf operand makes the outputs of its row (of a) or
    # column (of b) NaN; every other output is what it would be without those rows and columns
    a, b = operands(6, 96, 5, 9)
    a2, b2 = a.clone(), b.clone()
    a2[1, 5], b2[7, 2] = float("nan"), float("inf")
    for mode in ("fast", "promote"):
        want, got = gemm(a, b, mode), gemm(a2, b2, mode)
        assert got[1].isnan().all() and got[:, 2].isnan().all()
        keep = torch.ones_like(got, dtype=torch.bool)
        keep[1], keep[:, 2] = False, False
        assert torch.equal(got[keep], want[keep])


# --- the alignment rule: the largest sum of the operands' exponents, not the largest product ---

def lead(x: float) -> int:
    return math.frexp(x)[1] - 1  # x = m 2^lead, 1 <= |m| < 2


def reference(a, b, rule="exponents", floor=None, promote_every=None):
    """The model written out per output in FP64 scalars (every value here exact): each step of GROUP products and
    the running sum aligned to the largest exponent sum (rule "exponents", a floor lifting small operands) or the
    largest product's leading bit (rule "product", the lab's earlier model), cut toward zero to FRAC_BITS
    fraction bits, summed, normalised and cut again; promote_every: the partial sums added into FP32."""
    def step_sum(s, xs, ys):
        exps = [lead(x * y) if rule == "product" else max(lead(x), floor or -999) + max(lead(y), floor or -999)
                for x, y in zip(xs, ys) if x != 0 and y != 0] + ([lead(s)] if s else [])
        if not exps:
            return s
        grid = 2.0 ** (max(exps) - FRAC_BITS)
        total = (sum(math.trunc(x * y / grid) for x, y in zip(xs, ys)) + math.trunc(s / grid)) * grid
        return math.trunc(total / 2.0 ** (lead(total) - FRAC_BITS)) * 2.0 ** (lead(total) - FRAC_BITS) if total else 0.0

    def chain(xs, ys):
        s = 0.0
        for k0 in range(0, len(xs), GROUP):
            s = step_sum(s, xs[k0:k0 + GROUP], ys[k0:k0 + GROUP])
        return s

    out = torch.zeros(a.shape[0], b.shape[1])
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            xs, ys = a[i].tolist(), b[:, j].tolist()
            every = promote_every or len(xs)
            acc = torch.zeros((), dtype=torch.float32)
            for k0 in range(0, len(xs), every):
                acc = acc + torch.tensor(chain(xs[k0:k0 + every], ys[k0:k0 + every]), dtype=torch.float32)
            out[i, j] = acc
    return out


def test_a_step_aligns_to_the_operands_exponent_sum_not_to_the_product():
    # 1.875 x 1.875 = 3.515625: exponents 0 + 0 = 0, its product leads at 2^1. Aligned to 2^0, the grid is 2^-13
    # and two products of 1.5 2^-13 keep 2^-13 each (2^-12 together, kept by the normalised sum's grid 2^-12);
    # aligned to the product's 2^1 (the old rule) each is 0.75 of the grid 2^-12 and both are lost
    small = 1.5 * 2.0 ** -7
    a = torch.tensor([[1.875, small, small]])
    b = torch.tensor([[1.875], [2.0 ** -6], [2.0 ** -6]])
    assert gemm(a, b, "fast").item() == 1.875 ** 2 + 2.0 ** -12
    assert reference(a, b, rule="product").item() == 1.875 ** 2  # what the model gave before
    assert gemm(a, b, "fp32").item() == 1.875 ** 2 + 2 * 1.5 * 2.0 ** -13


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_a_subnormal_operand_counts_at_its_formats_smallest_normal_exponent(element):
    # E4M3: 2^-7 is a subnormal, counted at -6: with b = 2^6 the step aligns to -6 + 6 = 0, not to -1 (its
    # product 0.5's), so products of 1.5 2^-14 (0.75 of the grid 2^-13) are lost; without the floor they keep 2^-14
    # each. E5M2 the same 8 binades lower (its smallest normal exponent -14)
    emin = accumulate.MIN_EXPONENT[element]
    assert emin == {"e4m3": -6, "e5m2": -14}[element]
    shift = 2.0 ** (emin + 6)
    sub = 2.0 ** (emin - 1) * torch.ones(1)  # the format's largest power-of-two subnormal
    assert sub.to({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[element]).float().item() == sub.item()
    a = torch.cat([sub, torch.full((2,), 1.5 * 2.0 ** -14 * shift)])[None]
    b = torch.tensor([[2.0 ** 6], [1.0], [1.0]])
    assert gemm(a, b, "fast", a_floor=emin).item() == 0.5 * shift
    assert gemm(a, b, "fast").item() == 0.5 * shift + 2.0 ** -13 * shift  # no floor: the subnormal's own exponent


def e4m3_with_significands(m, k, n, significands, seed):
    """E4M3 operands whose significands are drawn from `significands`, exponents -6..8, random signs."""
    g = torch.Generator().manual_seed(seed)

    def draw(rows, cols):
        sig = torch.tensor(significands)[torch.randint(len(significands), (rows, cols), generator=g)]
        sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
        return sign * sig * torch.exp2(torch.randint(-6, 9, (rows, cols), generator=g).float())
    return draw(m, k), draw(k, n)


@pytest.mark.parametrize("mode", ["fast", "promote"])
def test_the_model_is_its_rule_written_out(mode):
    a, b = operands(5, 256, 4, 12)
    a[0, :40] = 0.0  # an all-zero step for output row 0, zero products elsewhere
    a[1, 3] = 2.0 ** -9  # E4M3's smallest subnormal
    every = PROMOTE_EVERY if mode == "promote" else None
    assert torch.equal(gemm(a, b, mode), reference(a, b, promote_every=every))
    assert torch.equal(gemm(a, b, mode, a_floor=-6, b_floor=-6), reference(a, b, floor=-6, promote_every=every))


def test_where_the_two_rules_agree_the_model_gives_its_old_bits():
    # significands whose products stay below 2 (1.375^2 = 1.89): every product leads at its exponent sum, the old
    # and the new rule are one, and the model (k_splits = 1, the default) is what it was
    a, b = e4m3_with_significands(6, 320, 5, [1.0, 1.125, 1.25, 1.375], 13)
    old = reference(a, b, rule="product")
    assert torch.equal(reference(a, b), old)
    assert torch.equal(gemm(a, b, "fast"), old) and torch.equal(gemm(a, b, "fast", k_splits=1), old)
    assert torch.equal(gemm(a, b, "promote"), reference(a, b, rule="product", promote_every=PROMOTE_EVERY))
    # with significands up to 1.875 the rules part, and the model follows the new one
    a, b = e4m3_with_significands(6, 320, 5, [1.5, 1.75, 1.875], 14)
    assert not torch.equal(reference(a, b, rule="product"), reference(a, b))
    assert torch.equal(gemm(a, b, "fast"), reference(a, b))


@pytest.mark.parametrize("mode", ["fp32", "fast", "promote"])
def test_a_k_split_is_its_parts_model_outputs_added_in_fp32(mode):
    a, b = operands(7, 1000, 6, 15)
    step = {"fp32": 1, "fast": GROUP, "promote": PROMOTE_EVERY}[mode]  # a model's part holds whole steps
    size = -(-(-(-1000 // 3)) // step) * step  # ceil(1000 / 3) = 334, rounded up to whole steps
    a[:, :size] *= 2.0 ** 14  # the first part's sums 2^14 larger: adding the parts in FP32 rounds
    parts = [gemm(a[:, k0:k0 + size], b[k0:k0 + size], mode) for k0 in range(0, 1000, size)]
    assert len(parts) == 3
    split = gemm(a, b, mode, k_splits=3)
    assert torch.equal(split, (parts[0] + parts[1]) + parts[2])
    assert not torch.equal(split, (parts[0].double() + parts[1] + parts[2]).float())  # FP32's rounding: it counts
    assert torch.equal(gemm(a, b, mode, k_splits=1), gemm(a, b, mode))
    if mode == "fast":  # three shorter chains lose less to the growing sum's grid than one
        exact = a.double() @ b.double()
        err = {s: (gemm(a, b, mode, k_splits=s).double() - exact).abs().median() for s in (1, 3)}
        assert err[3] < err[1]
    with pytest.raises(ValueError, match="k_splits"):
        gemm(a, b, mode, k_splits=0)


def test_a_recipe_passes_its_k_split_to_the_forward_gemm(monkeypatch):
    from lab.core.errors import ConfigError
    from lab.fp8 import create_recipe
    from lab.fp8.linear import RecipeLinear
    r = create_recipe({"name": "fp8-current", "accumulate": "fast", "k_splits": 3})
    assert (r.forward.accumulate, r.forward.k_splits) == ("fast", 3)
    assert (r.grad_input.k_splits, r.grad_weight.k_splits) == (1, 1)  # the gradient GEMMs: FP32, unsplit
    assert create_recipe({"name": "fp8-current", "accumulate": "fast"}).forward.k_splits == 1  # the default
    for bad in ({"k_splits": 2}, {"accumulate": "fast", "k_splits": 0}, {"accumulate": "promote", "k_splits": 1.5}):
        with pytest.raises(ConfigError, match="k_splits"):
            create_recipe({"name": "fp8-current", **bad})
    seen = []
    monkeypatch.setattr(accumulate, "gemm", lambda a, b, **kw: seen.append(kw) or torch.mm(a, b))
    layer = RecipeLinear.from_linear(torch.nn.Linear(64, 8), r, "layer")
    layer(torch.randn(4, 64))
    assert seen == [{"accumulate": "fast", "k_splits": 3}]

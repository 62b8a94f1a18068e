"""lab.formats.accumulate: FP32 accumulation is torch.mm bit for bit; the Hopper model's properties, from its definition
(aligned addends and sums cut toward zero to FRAC_BITS fraction bits, GROUP products a step), not from pinned numbers."""
import pytest
import torch

from lab.formats import accumulate
from lab.formats.accumulate import FRAC_BITS, GROUP, gemm

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
        assert c.dtype == torch.float32 and torch.equal(c, torch.mm(a, b))


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

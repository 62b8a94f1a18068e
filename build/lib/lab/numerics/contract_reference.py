"""The tensor-core contract as mathematics: an FP64 reference, one correct rounding, FP32 error bounds.

Nothing here calls a reduced-precision CPU kernel, so no assertion built on it depends on the CPU.

* `round_to(x, dtype)`: IEEE round-to-nearest-even of FP64 values to FP16/BF16 (subnormals, overflow to
  inf), by integer arithmetic on the FP64 value: one rounding, never through FP32 (a double rounding).
* `mixed`: operands that reach the corners of FP16 (subnormals, 2^-14, 65504, cancellation).
* `check_bilinear`: for an op whose every output element is a sum of k products of operand elements (conv,
  matmul, linear; plus a bias term): the exact value e (FP64 on the low-precision operands) and the sum of
  the terms' magnitudes A. An FP32 accumulation of exact products has |fp32 - e| <= gamma_k * A with
  gamma_k = k u / (1 - k u), u = 2^-24, whatever the summation order or blocking (Higham, Accuracy and
  Stability of Numerical Algorithms, 3.1); the FP64 reference's own error adds k 2^-53 A. Rounding is
  monotone, so the contract's result must lie in [round(e - bound), round(e + bound)]: equal to round(e)
  wherever e lies farther than the bound from a rounding boundary, one of the two neighbours where FP32
  summation order can flip the last bit, and wider only where terms cancel (A >> |e|).
"""
from __future__ import annotations

import torch

FP16, BF16 = torch.float16, torch.bfloat16
TINY16 = torch.finfo(FP16).tiny            # 2^-14, the smallest normal
SUB16 = TINY16 * torch.finfo(FP16).eps     # 2^-24, the smallest subnormal
MAX16 = torch.finfo(FP16).max              # 65504
U32 = 2.0 ** -24
U64 = 2.0 ** -53


def _format(dtype):
    fi = torch.finfo(dtype)
    precision = 1 - int(torch.log2(torch.tensor(fi.eps, dtype=torch.float64)))  # significand bits incl. hidden
    min_exp = int(torch.log2(torch.tensor(fi.tiny, dtype=torch.float64)))       # exponent of the smallest normal
    return precision, min_exp, fi.max


def round_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """Round FP64 values once, to nearest even, to the grid of `dtype`; returned as FP64."""
    precision, min_exp, max_finite = _format(dtype)
    x = x.to(torch.float64)
    _, exp = torch.frexp(x)                                  # |x| = m 2^exp, m in [0.5, 1)
    quantum = torch.clamp(exp - 1, min=min_exp) - (precision - 1)
    scaled = torch.ldexp(x, -quantum)                          # exact: a power-of-two scaling
    out = torch.ldexp(torch.round(scaled), quantum)            # torch.round: half to even
    out = torch.where(x == 0, x, out)
    out = torch.where(out.abs() > max_finite, torch.copysign(torch.full_like(x, float("inf")), x), out)
    return torch.where(torch.isfinite(x), out, x)


def fp32_bound(abs_sum: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Largest |FP32 accumulation - exact| for sums of `terms` exact products with magnitudes `abs_sum`."""
    k = terms.to(torch.float64)
    return (k * U32 / (1 - k * U32) + k * U64) * abs_sum


def assert_within_contract(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, dtype, what: str):
    """result (FP16/BF16) is a value the contract can produce: between round(e - bound) and round(e + bound)."""
    assert result.dtype == dtype, f"{what}: dtype {result.dtype}, the contract rounds to {dtype}"
    r = result.detach().to(torch.float64)
    lo, hi = round_to(exact - bound, dtype), round_to(exact + bound, dtype)
    ok = ((r >= lo) & (r <= hi)) | (r == lo) | (torch.isnan(r) & torch.isnan(exact))
    if not bool(ok.all()):
        i = int((~ok).flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements outside the contract; first at {i}: "
            f"got {r.flatten()[i].item()!r}, exact {exact.flatten()[i].item()!r}, allowed "
            f"[{lo.flatten()[i].item()!r}, {hi.flatten()[i].item()!r}]")
    return {"elements": ok.numel(), "must_be_exact": int((lo == hi).sum()),
            "equal_to_rounded_exact": int((r == round_to(exact, dtype)).sum())}


def check_bilinear(fn, operands: list[torch.Tensor], result: torch.Tensor, grads: list, cotangent: torch.Tensor,
                   dtype, what: str) -> dict:
    """Check an op's output and its operands' gradients against the FP64 reference under the contract.

    fn(*operands) must be a sum of products of one element of each of two operands (plus, optionally, a
    third operand added once: a bias), with coefficients +1, like conv, matmul or linear. Operands and the
    cotangent are the low-precision values the op received (cast by autocast); `grads[i]` is the gradient
    the contract computed for operand i (or None).
    """
    ops64 = [t.detach().to(torch.float64) for t in operands]
    g64 = cotangent.detach().to(torch.float64)
    exact, vjp = torch.func.vjp(fn, *ops64)
    abs_out, abs_vjp = torch.func.vjp(fn, *[t.abs() for t in ops64])
    ones_out, ones_vjp = torch.func.vjp(fn, *[torch.ones_like(t) for t in ops64])
    report = {"output": assert_within_contract(result, exact, fp32_bound(abs_out, ones_out), dtype,
                                               f"{what} output")}
    for i, (g_exact, g_abs, g_terms) in enumerate(zip(vjp(g64), abs_vjp(g64.abs()),
                                                     ones_vjp(torch.ones_like(g64)))):
        if grads[i] is not None:
            report[f"grad{i}"] = assert_within_contract(grads[i], g_exact, fp32_bound(g_abs, g_terms), dtype,
                                                        f"{what} gradient of operand {i}")
    return report


def attention_reference(q, k, v, dout, mask=None, is_causal=False, scale=None, keep=None, dropout_p=0.0):
    """FP64 attention output and gradients on the low-precision values, and first-order FP32 error bounds.

    The bounds follow each FP32 stage: scores s = q.k*scale (error gamma_d sum|q||k| scale), softmax
    (relative error of p about |ds| + 4u), products with V and dO (gamma_n), the row term
    sum(dP*P) and the products with K and Q; every bound is doubled for the second-order terms this skips.
    """
    q, k, v, dout = (t.detach().to(torch.float64) for t in (q, k, v, dout))
    m = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(torch.float64))
    d, n = q.shape[-1], k.shape[-2]
    scale = d ** -0.5 if scale is None else scale
    keep_f = None if keep is None else keep.to(torch.float64) / (1 - dropout_p)

    def attn(q, k, v):
        s = q @ k.transpose(-2, -1) * scale
        blocked = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1) if is_causal else None
        if m is not None and m.dtype == torch.bool:
            blocked = ~m if blocked is None else blocked | ~m
        elif m is not None:
            s = s + m
        if blocked is not None:
            s = s.masked_fill(blocked, float("-inf"))
        p = torch.softmax(s, -1)
        if blocked is not None:
            p = p.masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0)
        pd = p if keep_f is None else p * keep_f
        return pd @ v, p

    (out, p), vjp = torch.func.vjp(attn, q, k, v)
    dq, dk, dv = vjp((dout, torch.zeros_like(p)))
    g = lambda j: j * U32 / (1 - j * U32) + j * U64  # noqa: E731
    eps_s = g(d) * (q.abs() @ k.abs().transpose(-2, -1)) * scale + 4 * U32   # absolute error of the scores
    eps_p = eps_s + eps_s.amax(-1, keepdim=True) + g(n) + 4 * U32                    # relative error of p
    pd = p if keep_f is None else p * keep_f
    b_out = 2 * ((pd * eps_p) @ v.abs() + g(n) * (pd @ v.abs()))
    dpd = dout @ v.transpose(-2, -1)
    dp = dpd if keep_f is None else dpd * keep_f
    e_dp = g(d) * (dout.abs() @ v.abs().transpose(-2, -1))
    if keep_f is not None:
        e_dp = e_dp * keep_f
    delta = (dp * p).sum(-1, keepdim=True)
    e_delta = ((e_dp + dp.abs() * eps_p) * p).sum(-1, keepdim=True) + g(n) * (dp * p).abs().sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    e_ds = (p * (e_dp + e_delta + U32 * (dp.abs() + delta.abs())) * scale + ds.abs() * (eps_p + 2 * U32))
    b_dq = 2 * (e_ds @ k.abs() + g(n) * (ds.abs() @ k.abs()))
    b_dk = 2 * (e_ds.transpose(-2, -1) @ q.abs() + g(n) * (ds.abs().transpose(-2, -1) @ q.abs()))
    b_dv = 2 * ((pd * eps_p).transpose(-2, -1) @ dout.abs() + g(n) * (pd.transpose(-2, -1) @ dout.abs()))
    return {"out": (out, b_out), "dq": (dq, b_dq), "dk": (dk, b_dk), "dv": (dv, b_dv)}


def mixed(*shape, dtype=FP16, seed=0, cancel=False):
    """Test operands. Low-precision values, slices along dim 0 at different magnitudes: ordinary, near 2^-14, subnormal
    (multiples of 2^-24), large (up to +-65504 for FP16); with `cancel`, pairs along the last dim that
    nearly cancel (x, -x + one ulp)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    n = shape[0]
    if dtype == FP16 and n >= 4:
        x[1::4] *= TINY16 * 4
        x[2::4] = torch.randint(-6, 7, x[2::4].shape, generator=g) * SUB16
        x[3::4] *= 64
        x[3].view(-1)[:3] = torch.tensor([MAX16, -MAX16, 60000.0])[: x[3].numel()]
    if cancel and shape[-1] >= 2:
        x[..., 1::2] = -x[..., 0::2][..., : x[..., 1::2].shape[-1]]
    out = round_to(x, dtype)
    if cancel and shape[-1] >= 2:  # break exact cancellation by one ulp in every other pair
        out[..., 1::4] = torch.nextafter(out[..., 1::4].to(dtype), torch.tensor(float("inf"), dtype=dtype)).double()
    return out.to(dtype)

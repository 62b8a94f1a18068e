"""FP64 references of the block-scaled formats, written from their specifications and not from any implementation:
the tests hold lab.formats.mx and lab.formats.nvfp4 (and so torchao's quantizers) against them.

OCP Microscaling Formats (MX) v1.0: 32 elements along k share an E8M0 scale X = 2^p, p in [-127, 127]; the elements
x / X are rounded to nearest (ties to even) and saturate at the element's largest finite value. The spec's p is
floor(log2 amax) - emax_elem (emax_elem: the element's largest exponent, 8 / 15 / 2 for E4M3 / E5M2 / E2M1); the
other rules the lab runs: ceil (ceil(log2 amax) - emax_elem), rceil (the smallest p with amax / 2^p <= the element's
max: no element clips; cuBLAS's and Transformer Engine's rule) and even (floor of log2 of amax rounded half up to the
element's mantissa width). A block holding a NaN is NaN (E8M0's NaN scale); an all-zero block takes p = -127.

NVFP4 (arXiv:2509.25149; Transformer Engine): E2M1 elements in 16-element blocks along k (or 16x16 blocks), E4M3 block
scales, an FP32 tensor scale. global = 448 * 6 / amax_tensor; block scale s = amax_block / 6 * global, cast to E4M3;
elements = x / (s_e4m3 / global) rounded to E2M1; dequantized = elements * s_e4m3 / global. An all-zero tensor takes
global = 1 (Transformer Engine). `clamp_scale` picks what happens to a block scale below E4M3's smallest normal (2^-6):
False, the format's letter (an E4M3 cast, subnormals included; a scale that rounds to 0 zeroes its block); True, the
lab's (and torchao's) choice, the scale clamped to [2^-6, 448] before the cast.

Inputs are FP64 tensors (FP32 values widened: exact); every operation below on them is exact except the NVFP4 scale
arithmetic (one FP64 rounding each: the tests allow for FP32 arithmetic only at a rounding tie). Infinite inputs are
outside these references (the formats leave them undefined).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: element formats from their specifications: mantissa bits, smallest normal exponent, largest exponent, max finite
SPEC = {"e4m3": (3, -6, 8, 448.0), "e5m2": (2, -14, 15, 57344.0), "e2m1": (1, 0, 2, 6.0)}
E8M0_MIN, E8M0_MAX = -127, 127
E4M3_MIN_NORMAL = 2.0 ** -6


class Ref(NamedTuple):
    """A reference quantization, all FP64 in x's shape: `values` dequantized, `elements` on the element grid (x over
    its scale, rounded), `scales` each element's decode scale; `saturated` (what lab.formats.Quantized's
    `clipped` marks) and `flushed` (non-zero elements quantized to zero), Python ints."""
    values: torch.Tensor
    elements: torch.Tensor
    scales: torch.Tensor
    saturated: int
    flushed: int


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 v) exactly for finite v > 0 (frexp: v = m * 2^e, m in [0.5, 1)); log2 in floating point can round
    up to the next integer just below a power of two."""
    m, e = torch.frexp(v)
    return (e - 1).to(torch.float64)


def ref_cast(x64: torch.Tensor, element: str) -> torch.Tensor:
    """x64 rounded to nearest, ties to even, onto the element's grid (subnormals included), saturating at its max."""
    mbits, emin, _, top = SPEC[element]
    mag = x64.abs()
    exp = _floor_log2(torch.where(mag > 0, mag, torch.ones_like(mag))).clamp(min=emin)
    quantum = torch.exp2(exp - mbits)
    rounded = torch.round(mag / quantum) * quantum  # torch.round: ties to even; mag / quantum is exact
    out = torch.copysign(rounded.clamp(max=top), x64)
    return torch.where(torch.isnan(x64), x64, out)


def _k_last(x64: torch.Tensor, k_dim: int) -> torch.Tensor:
    if x64.dim() != 2:
        raise ValueError(f"reference quantizers take 2-D tensors, got shape {tuple(x64.shape)}")
    return x64.movedim(k_dim, -1)


def _block_amax(xk: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each element's block amax (blocks of rows x cols, k last); NaN where the block holds a NaN."""
    m, k = xk.shape
    if m % rows or k % cols:
        raise ValueError(f"shape {tuple(xk.shape)} (k last) does not divide into {rows}x{cols} blocks")
    blocks = xk.abs().reshape(m // rows, rows, k // cols, cols)
    amax = blocks.amax(dim=(1, 3), keepdim=True)  # amax propagates NaN
    return amax.expand_as(blocks).reshape(m, k)


def mx_exponent(amax: torch.Tensor, element: str, rounding: str) -> torch.Tensor:
    """The E8M0 exponent p of each block (FP64, NaN where amax is NaN) under the scale rule `rounding`."""
    mbits, _, emax, top = SPEC[element]
    pos = torch.where(amax > 0, amax, torch.ones_like(amax))  # zero (and NaN) blocks: fixed below
    if rounding == "floor":
        p = _floor_log2(pos) - emax
    elif rounding == "ceil":
        p = _floor_log2(pos) + (torch.frexp(pos)[0] != 0.5).double() - emax  # + 1 unless amax is a power of two
    elif rounding == "even":
        quantum = torch.exp2(_floor_log2(pos) - mbits)
        p = _floor_log2(torch.floor(pos / quantum + 0.5) * quantum) - emax
    elif rounding == "rceil":
        p = torch.ceil(torch.log2(pos / top))
        # log2 and the division round: settle p on the definition with exact power-of-two comparisons
        p = p + (pos / torch.exp2(p) > top).double()
        p = p - (pos / torch.exp2(p - 1) <= top).double()
    else:
        raise ValueError(f"MX scale rounding {rounding!r} is not one of floor, ceil, rceil, even")
    p = torch.where(amax > 0, p, torch.full_like(p, E8M0_MIN)).clamp(E8M0_MIN, E8M0_MAX)
    return torch.where(torch.isnan(amax), amax, p)


def _finish(x64, elements, scales, element: str) -> Ref:
    values = elements * scales
    mbits, _, _, top = SPEC[element]
    bound = top + 2.0 ** (math.floor(math.log2(top)) - mbits) / 2  # what rounds to max: beyond it, clipped
    with torch.no_grad():
        # NaN compares False: not counted; nor is a block whose scale is 0 (zeroed, not clipped)
        saturated = int(((scales > 0) & (x64.abs() > bound * scales)).sum())
        flushed = int(((x64 != 0) & (values == 0)).sum())
    return Ref(values, elements, scales, saturated, flushed)


def ref_mx(x64: torch.Tensor, k_dim: int, element: str, rounding: str = "floor") -> Ref:
    """OCP MX v1.0: 32-element blocks along k_dim, E8M0 scale by `rounding`, elements RNE with saturation."""
    xk = _k_last(x64, k_dim)
    scales = torch.exp2(mx_exponent(_block_amax(xk, 1, 32), element, rounding))
    elements = ref_cast(xk / scales, element)
    ref = _finish(xk, elements, scales, element)
    return Ref(*(t.movedim(-1, k_dim) for t in ref[:3]), *ref[3:])


def ref_nvfp4(x64: torch.Tensor, k_dim: int, two_d: bool = False, clamp_scale: bool = True) -> Ref:
    """NVFP4: 1x16 blocks along k_dim (or 16x16), E4M3 block scales under a tensor scale 448 * 6 / amax."""
    xk = _k_last(x64, k_dim)
    amax_t = xk.abs().max()
    glob = torch.where(amax_t > 0, 448.0 * 6.0 / amax_t, torch.ones_like(amax_t))
    s = _block_amax(xk, 16 if two_d else 1, 16) / 6.0 * glob
    if clamp_scale:
        s = s.clamp(E4M3_MIN_NORMAL, 448.0)
    s_e4m3 = ref_cast(s, "e4m3")
    decode = s_e4m3 / glob
    safe = torch.where(decode > 0, decode, torch.ones_like(decode))
    elements = torch.where(decode > 0, ref_cast(xk / safe, "e2m1"), torch.zeros_like(xk))
    elements = torch.where(torch.isnan(xk), xk, elements)
    ref = _finish(xk, elements, decode, "e2m1")
    return Ref(*(t.movedim(-1, k_dim) for t in ref[:3]), *ref[3:])

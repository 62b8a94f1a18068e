"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements along k (or per 16x16 block), an FP32 per-tensor scale.

Two-level scaling (arXiv:2509.25149; Transformer Engine): the tensor scale maps the tensor's amax to E4M3's max times
E2M1's (torchao keeps its reciprocal, per_tensor_scale = amax / (448 * 6)); a block's scale amax_block / 6 in those
units is cast to E4M3; elements x * (1 / per_tensor_scale) / scale_e4m3 are clipped to +-6 and rounded to E2M1;
dequantized = elements * (per_tensor_scale * scale_e4m3).

The lab's own quantizer, in torchao's FP32 arithmetic step for step, so that in 1x16 round-to-nearest mode it equals
torchao's `NVFP4Tensor.to_nvfp4` and its `dequantize` (the recipe its users run) bit for bit (tested), with 16x16
blocks (`two_d`: the paper's weights, one scale per block so that W and W^T quantize alike) and stochastic rounding
(the paper's gradients) besides. It works on x viewed as blocks, each block's scale computed once and broadcast
(not per element), and rounds to E2M1 arithmetically (`round_e2m1`, tested equal to torchao's cast): torchao's CPU
path packs and unpacks bit fields in a dozen elementwise passes.

Choices, each tested against lab.formats.reference:
- a block scale below E4M3's smallest normal (2^-6, a block ~2^-15 of the tensor's amax or smaller) is clamped to
  2^-6 as torchao does, so such a block keeps coarse non-zero values; the format's letter casts it to E4M3 with
  subnormals, and a scale that rounds to 0 zeroes the block (reference.ref_nvfp4(clamp_scale=False));
- an all-zero tensor quantizes to zeros (torchao: 0 / 0, NaN everywhere; Transformer Engine takes a tensor scale of 1);
- a NaN or an inf anywhere makes the whole tensor NaN (its amax, so every scale, is NaN or inf), as in torchao.
"""
from __future__ import annotations

import torch

from lab.formats.elements import FP4_MAX, Quantized, fp8_to_float, overflow_bound
from lab.formats.kernels import edge_operands, fused, fusing
from lab.formats.rounding import DRAW_BITS, draws_from_words, e2m1_quantum, round_with_draws, uniform_words

BLOCK = 16
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6  # torchao's E4M3_EPS: torch.finfo(float8_e4m3fn).tiny


def _k_last(x: torch.Tensor, k_dim: int, two_d: bool) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D tensor, got shape {tuple(x.shape)}")
    xk = x.detach().movedim(k_dim, -1).contiguous()  # in x's dtype: converted to FP32 in the kernel
    if xk.shape[-1] % BLOCK or (two_d and xk.shape[0] % BLOCK):
        need = f"both dimensions multiples of {BLOCK}" if two_d else f"dimension {k_dim} a multiple of {BLOCK}"
        raise ValueError(f"NVFP4 {'16x16' if two_d else '1x16'} blocks need {need}, got shape {tuple(x.shape)}")
    return xk


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """FP32 values within +-6 rounded to nearest (ties to even) on E2M1's grid 0, 0.5, 1, 1.5, 2, 3, 4, 6: the
    multiple of the binade's quantum (e2m1_quantum) nearest x, which torch.round takes to even, as an even multiple
    is an even E2M1 code. NaN stays NaN (torchao's cast gives +-1.5; only a NaN or inf tensor has one, and its
    scales make every value NaN either way)."""
    quantum = e2m1_quantum(x)
    return torch.round(x / quantum) * quantum  # division and product by a power of two: exact


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    """Each block's amax of xb (row blocks, rows, blocks, 16), keepdim: over the 16 along k by halving (torch's
    reduction over 16 contiguous values is ~2x slower than these maxima), then over the block's rows."""
    a = xb.abs()
    if fusing():  # fused, one vector a block; the halving's slices compile to 2-wide loads
        a = a.amax(dim=-1, keepdim=True)  # a maximum: the same value in any order, NaN propagated alike
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = torch.maximum(a[..., :half], a[..., half:])
    return a.amax(dim=1, keepdim=True) if a.shape[1] > 1 else a


def _parts(xk: torch.Tensor, rows: int, stochastic: bool = False, generator=None, parts: bool = True,
           tensor_scale: torch.Tensor | None = None):
    """The NVFP4 of xk (FP32, k last) in blocks rows x 16, on xk viewed as (row blocks, rows, blocks, 16):
    (elements on the E2M1 grid in that view, each block's E4M3 scale as FP32 broadcastable against it,
    per_tensor_scale, the tensor's amax, the dequantized values), every FP32 step as torchao's nvfp4_quantize and
    dequantize take it; `parts` False: the values and the block scales, (None, scale, None, None, values).
    tensor_scale: per_tensor_scale given (a 0-d FP32 tensor), or None: computed from xk's amax."""
    # stochastic: one draw per element in xk's order (the blocks' view is xk's memory, row-major), drawn outside the
    # fused kernel (the compiler's random numbers are not torch.rand's), as integers two to a word (~40% faster to
    # draw than torch.rand), unpacked in the kernel
    u = uniform_words(xk, generator) if stochastic else None
    return _nvfp4(xk, u, rows, parts, tensor_scale)


def _probe(xk, u, rows, parts, tensor_scale) -> list[tuple]:
    draws = None if u is None else uniform_words(xk, torch.Generator().manual_seed(1))
    return [(t, draws, rows, parts, tensor_scale) for t in edge_operands(*xk.shape) + [torch.zeros_like(xk)]]


@fused(_probe)
def _nvfp4(xk: torch.Tensor, u: torch.Tensor | None, rows: int, parts: bool, tensor_scale: torch.Tensor | None):
    """_parts' arithmetic (u: the stochastic rounding's draws as generator words, rounding.uniform_words, or None:
    round to nearest; tensor_scale: per_tensor_scale, or None: torchao's from the amax). Fused (lab.formats.kernels): the values alone take one pass over xk's memory, where eager takes
    about a dozen."""
    m, k = xk.shape
    xb = xk.to(torch.float32).view(m // rows, rows, k // BLOCK, BLOCK)  # exact; fused, no pass of its own
    block_amax = _block_amax(xb)
    amax = block_amax.amax()  # the tensor's: the largest block amax
    # an all-zero tensor: torchao's tensor scale 0 would make every value 0 / 0; 1 makes them zeros
    if tensor_scale is None:
        per_tensor_scale = torch.where(amax == 0, 1.0, amax.to(torch.float32) / (E4M3_MAX * FP4_MAX))  # torchao's
    else:
        per_tensor_scale = tensor_scale
    block_scale = block_amax / FP4_MAX / per_tensor_scale
    e4m3 = block_scale.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = e4m3.to(torch.float32) if fusing() else fp8_to_float(e4m3)  # the same values
    scaled = (xb * ((1.0 / per_tensor_scale) / scale)).clamp(-FP4_MAX, FP4_MAX)
    if u is not None:  # the draws uniform_draws gives: k * 2^-24, exact in FP32
        draws = draws_from_words(u, scaled.shape).to(torch.float32) * 2.0 ** -DRAW_BITS
        elements = round_with_draws(scaled, "e2m1", draws)
    else:
        elements = round_e2m1(scaled)
    # torchao's dequantize (the combined scale first); + -0.0 leaves every value as it is, bit for bit, but an
    # all-zero tensor's are made +0 (a pass of an add: a masked fill with a 0-d mask is ~4x slower)
    values = (elements * (per_tensor_scale * scale)).add_(torch.where(amax == 0, 0.0, -0.0)).view(m, k)
    # the block scales returned either way: fused, a kernel output gets a vectorized loop over the blocks of its own,
    # where inlined into the elements' loop each block's scale is computed in scalar code (~1.3x the kernel's time)
    return (elements, scale, per_tensor_scale, amax, values) if parts else (None, scale, None, None, values)


def own_parts(xk: torch.Tensor, rows: int = 1, stochastic: bool = False, generator=None):
    """The lab's NVFP4 of xk (FP32, k last) in blocks rows x 16, in xk's shape: (elements on the E2M1 grid, each
    element's E4M3 block scale as FP32, per_tensor_scale)."""
    elements, scale, per_tensor_scale, _, _ = _parts(xk, rows, stochastic, generator)
    return elements.reshape(xk.shape), scale.expand_as(elements).reshape(xk.shape), per_tensor_scale


def _tensor_scale(value, device) -> torch.Tensor:
    """A given tensor scale as the kernel takes it: a 0-d FP32 tensor (FP32, as torchao keeps it), checked once
    (a host read, only where a scale is given): 0, a negative or a non-finite one would make every value NaN."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device).detach()
    if t.numel() != 1 or not bool(torch.isfinite(t) & (t > 0)):
        raise ValueError(f"NVFP4's tensor_scale must be one positive finite FP32 number, got {value!r}")
    return t.reshape(())


def quantize_nvfp4(x: torch.Tensor, k_dim: int, two_d: bool = False, stochastic: bool = False,
                   generator: torch.Generator | None = None, stats: bool = False,
                   tensor_scale: torch.Tensor | float | None = None) -> Quantized:
    """x (2-D) quantized to NVFP4 in 1x16 blocks along k_dim, or 16x16 blocks (`two_d`); `stochastic` rounds the
    elements stochastically with `generator` (the scales round to nearest: the paper's recipe). tensor_scale: the
    FP32 tensor scale (torchao's per_tensor_scale, amax / (448 * 6): a scale kept from another tensor or step), a
    positive finite number; None: computed from x's amax.
    stats: `elements` and `clipped`, the elements whose scaled magnitude rounds beyond 6 (> 7,
    lab.formats.overflow_bound: the E4M3 scale rounded below amax / 6)."""
    xk = _k_last(x, k_dim, two_d)
    given = None if tensor_scale is None else _tensor_scale(tensor_scale, xk.device)
    elements, scale, per_tensor_scale, _, values = _parts(xk, BLOCK if two_d else 1, stochastic, generator, stats,
                                                          given)
    values = values.movedim(-1, k_dim)
    if not stats:
        return Quantized(values)
    # what was clipped to +-6 (NaN for a zero tensor: not counted)
    scaled = xk.float().view(elements.shape) * ((1.0 / per_tensor_scale) / scale)

    def as_x(t):  # the blocks' layout -> x's shape, as the values were
        return t.reshape(xk.shape).movedim(-1, k_dim)
    return Quantized(values, as_x(elements), as_x(scaled.abs() > overflow_bound("e2m1")))

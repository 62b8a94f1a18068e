"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements along k (or per 16x16 block), an FP32 per-tensor scale.

Two-level scaling (arXiv:2509.25149; Transformer Engine): the tensor scale maps the tensor's amax to E4M3's max times
E2M1's (torchao keeps its reciprocal, per_tensor_scale = amax / (448 * 6)); a block's scale amax_block / 6 in those
units is cast to E4M3; elements x * (1 / per_tensor_scale) / scale_e4m3 are clipped to +-6 and rounded to E2M1;
dequantized = elements * (per_tensor_scale * scale_e4m3).

1x16 blocks rounded to nearest: torchao's `NVFP4Tensor.to_nvfp4` and its `dequantize` (the recipe its users run).
16x16 blocks (`two_d`: the paper's weights, one scale per block so that W and W^T quantize alike) and stochastic
rounding (the paper's gradients): the lab's own, in torchao's FP32 arithmetic step for step, so that in 1x16 round-to-
nearest mode it equals torchao bit for bit (tested), and E2M1 rounding through torchao's own cast.

Choices, each tested against lab.formats.reference:
- a block scale below E4M3's smallest normal (2^-6, a block ~2^-15 of the tensor's amax or smaller) is clamped to
  2^-6 as torchao does, so such a block keeps coarse non-zero values; the format's letter casts it to E4M3 with
  subnormals, and a scale that rounds to 0 zeroes the block (reference.ref_nvfp4(clamp_scale=False));
- an all-zero tensor quantizes to zeros (torchao: 0 / 0, NaN everywhere; Transformer Engine takes a tensor scale of 1);
- a NaN or an inf anywhere makes the whole tensor NaN (its amax, so every scale, is NaN or inf), as in torchao.
"""
from __future__ import annotations

import warnings

import torch

from lab.formats.elements import FP4_MAX, Quantized, overflow_bound
from lab.formats.rounding import stochastic_round

BLOCK = 16
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6  # torchao's E4M3_EPS: torch.finfo(float8_e4m3fn).tiny


def _torchao():
    """torchao's NVFP4 pieces, imported when first used (slow, and it warns about pytree registrations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    return NVFP4Tensor, per_tensor_amax_to_scale, f32_to_f4_unpacked, f4_unpacked_to_f32


def _k_last(x: torch.Tensor, k_dim: int, two_d: bool) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D tensor, got shape {tuple(x.shape)}")
    xk = x.detach().movedim(k_dim, -1).to(torch.float32).contiguous()
    if xk.shape[-1] % BLOCK or (two_d and xk.shape[0] % BLOCK):
        need = f"both dimensions multiples of {BLOCK}" if two_d else f"dimension {k_dim} a multiple of {BLOCK}"
        raise ValueError(f"NVFP4 {'16x16' if two_d else '1x16'} blocks need {need}, got shape {tuple(x.shape)}")
    return xk


def _block_amax(xk: torch.Tensor, rows: int) -> torch.Tensor:
    """Each element's block amax (blocks rows x 16, k last), in x's layout: the scales then apply elementwise."""
    m, k = xk.shape
    blocks = xk.abs().reshape(m // rows, rows, k // BLOCK, BLOCK)
    return blocks.amax(dim=(1, 3), keepdim=True).expand_as(blocks).reshape(m, k)


def own_parts(xk: torch.Tensor, rows: int = 1, stochastic: bool = False, generator=None):
    """The lab's NVFP4 of xk (FP32, k last) in blocks rows x 16: (elements on the E2M1 grid, each element's E4M3
    block scale as FP32, per_tensor_scale), every FP32 step as torchao's nvfp4_quantize takes it."""
    _, amax_to_scale, to_f4, from_f4 = _torchao()
    per_tensor_scale = amax_to_scale(xk.abs().amax())
    block_scale = _block_amax(xk, rows) / FP4_MAX / per_tensor_scale
    scale = block_scale.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scaled = (xk * ((1.0 / per_tensor_scale) / scale)).clamp(-FP4_MAX, FP4_MAX)
    if stochastic:
        elements = stochastic_round(scaled, "e2m1", generator)
    else:
        elements = from_f4(to_f4(scaled.contiguous()))
    return elements, scale, per_tensor_scale


def torchao_parts(xk: torch.Tensor):
    """torchao's NVFP4 of xk (FP32, k last, 1x16 blocks, round to nearest), as own_parts returns it, and its
    dequantized values."""
    nvfp4, amax_to_scale, _, from_f4 = _torchao()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.kernels import unpack_uint4
    t = nvfp4.to_nvfp4(xk, per_tensor_scale=amax_to_scale(xk.abs().amax()))
    elements = from_f4(unpack_uint4(t.qdata.view(torch.uint8))).reshape(xk.shape)
    scale = t.scale.to(torch.float32).repeat_interleave(BLOCK, dim=-1)
    return elements, scale, t.per_tensor_scale, t.dequantize(torch.float32)


def quantize_nvfp4(x: torch.Tensor, k_dim: int, two_d: bool = False, stochastic: bool = False,
                   generator: torch.Generator | None = None, stats: bool = False) -> Quantized:
    """x (2-D) quantized to NVFP4 in 1x16 blocks along k_dim, or 16x16 blocks (`two_d`); `stochastic` rounds the
    elements stochastically with `generator` (the scales round to nearest: the paper's recipe).
    stats: `saturated` counts elements whose scaled magnitude rounds beyond 6 (> 7, lab.formats.overflow_bound: clipped: the E4M3 scale rounded below
    amax / 6), `flushed` non-zero elements that came back 0."""
    xk = _k_last(x, k_dim, two_d)
    if two_d or stochastic:
        elements, scale, per_tensor_scale = own_parts(xk, BLOCK if two_d else 1, stochastic, generator)
        values = elements * (per_tensor_scale * scale)  # torchao's dequantize: the combined scale first
    else:
        _, scale, per_tensor_scale, values = torchao_parts(xk)
    amax = xk.abs().amax()
    values = torch.where(amax == 0, torch.zeros_like(values), values)  # all zero: zeros, not torchao's 0/0
    values = values.movedim(-1, k_dim)
    if not stats:
        return Quantized(values)
    scaled = xk * ((1.0 / per_tensor_scale) / scale)  # what was clipped to +-6 (NaN for a zero tensor: not counted)
    saturated = (scaled.abs() > overflow_bound("e2m1")).sum()
    flushed = ((xk != 0) & (values.movedim(k_dim, -1) == 0)).sum()
    return Quantized(values, saturated, flushed)

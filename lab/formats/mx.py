"""MX (OCP Microscaling v1.0): 32 elements along k share an E8M0 (power-of-two) scale; elements E4M3, E5M2 or E2M1.

The quantizer is torchao's (`to_mx`, dequantized by its `to_dtype`): what torchao's MX recipes train with, bit for bit.
Scale rounding: floor (the spec's), ceil, rceil (cuBLAS / Transformer Engine: the smallest power of two under which no
element clips), even (floor after rounding amax to the element's mantissa width).

What torchao does at the edges, and so what the lab does (tests/test_formats_blocks.py checks each against the FP64
reference of lab.formats.reference):
- an all-zero block: scale 2^-127, elements 0;
- a NaN anywhere in a block: its scale is E8M0's NaN, the whole block dequantizes to NaN;
- an inf in a block: the scale is set by inf's exponent bits (the largest), the inf element clips to the element max
  and dequantizes to inf (max * scale overflows FP32), the block's finite elements flush to 0;
- blocks whose amax is below about 2^-118 (FP32 values near its subnormal range), where torchao departs from the
  spec: floor/ceil/even with scale 2^-127 divide by 2^-126 (FP32's smallest normal) but multiply back by 2^-127, so
  their values come back halved; rceil with scale 2^-127 scales by 1 instead of 2^127, so the block flushes to 0;
- rceil computes log2(amax / max) in FP32: where amax / max lies within FP32's log2 error just above a power of two,
  its scale is the power of two below the spec's and the block's largest elements clip.
"""
from __future__ import annotations

import functools
import warnings

import torch

from lab.formats.elements import MX_ROUNDINGS, Quantized, fp8_to_float, overflow_bound
from lab.formats.kernels import edge_operands, fused, fusing

BLOCK = 32


@functools.cache
def _scale_modes():
    """torchao's ScaleCalculationMode, its MX module imported with it when first used (the import is slow and warns
    about pytree registrations; done here, the fused kernel's tracing only looks the module up); once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats import mx_tensor  # noqa: F401 (imported for _to_mx)
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    return ScaleCalculationMode


def _elem_dtype(element: str):
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}[element]


def _check(x: torch.Tensor, k_dim: int, element: str, scale_rounding: str) -> None:
    if element not in ("e4m3", "e5m2", "e2m1"):
        raise ValueError(f"MX element {element!r} is not one of e4m3, e5m2, e2m1")
    if scale_rounding not in MX_ROUNDINGS:
        raise ValueError(f"MX scale rounding {scale_rounding!r} is not one of {', '.join(MX_ROUNDINGS)}")
    if x.dim() != 2:
        raise ValueError(f"quantize_mx takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.shape[k_dim] % BLOCK:
        raise ValueError(f"MX blocks are {BLOCK} values along k: dimension {k_dim} of shape {tuple(x.shape)} "
                         f"is not a multiple of {BLOCK} (pad k with zeros first)")


def _quantize(x: torch.Tensor, k_dim: int, element: str, scale_rounding: str):
    """torchao's MX quantization of x, k last in blocks: (values FP32 (rows, blocks, 32), each block's scale FP32
    (rows, blocks, 1))."""
    _check(x, k_dim, element, scale_rounding)
    # torchao blocks the last dimension of a contiguous tensor: put k there (a copy in x's own dtype: converting
    # while transposing is slow on the CPU), and back afterwards; converted to FP32 in the kernel
    xk = x.detach().movedim(k_dim, -1).contiguous()
    values, scales = _to_mx(xk, _elem_dtype(element), getattr(_scale_modes(), scale_rounding.upper()))
    return values.reshape(*xk.shape[:-1], -1, BLOCK), scales


def _probe(xk, dtype, mode) -> list[tuple]:
    return [(t, dtype, mode) for t in edge_operands(*xk.shape)]


# inductor fuses each block's scale into its amax loop as scalar code; kept to kernels of at most two nodes, the
# scales get a vectorized loop of their own: ~1.3x faster on the study's operands (E4M3 floor and rceil), the same bits
@fused(_probe, options={"max_fusion_size": 2})
def _to_mx(xk: torch.Tensor, dtype: torch.dtype, mode) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's `to_mx` of xk (k last, contiguous) in FP32 and its dequantization: (values FP32 (rows, k),
    scales FP32 (rows, blocks, 1)). Fused (lab.formats.kernels): torchao writes `to_mx` for compilation."""
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_dtype, to_mx  # imported: _quantize
    xk = xk.to(torch.float32)  # exact (BF16 or FP16 activations); fused, no pass of its own
    scale, data = to_mx(xk, dtype, BLOCK, mode)
    scales = get_fp_scale(scale).reshape(*xk.shape[:-1], -1, 1)
    if dtype == torch.float4_e2m1fn_x2:
        return to_dtype(data, scale, dtype, BLOCK, torch.float32), scales
    # torchao's to_dtype for FP8 elements: the elements in FP32 (exact) times their block's scale; eager, by table
    # lookup (the CPU's elementwise FP8 conversion is a scalar path), fused, by the conversion (the same values)
    elements = data.to(torch.float32) if fusing() else fp8_to_float(data)
    return (elements.reshape(scales.shape[:-1] + (BLOCK,)) * scales).reshape(xk.shape), scales


def mx_parts(x: torch.Tensor, k_dim: int, element: str = "e4m3", scale_rounding: str = "floor"):
    """torchao's MX quantization of x: (values FP32 in x's shape, scales FP32 in x's shape: each element's block
    scale as the dequantization applies it)."""
    values, scales = _quantize(x, k_dim, element, scale_rounding)
    xk_shape = values.shape[:-2] + (-1,)
    return values.reshape(xk_shape).movedim(-1, k_dim), scales.expand_as(values).reshape(xk_shape).movedim(-1, k_dim)


def quantize_mx(x: torch.Tensor, k_dim: int, element: str = "e4m3", scale_rounding: str = "floor",
                stats: bool = False) -> Quantized:
    """x (2-D; its k_dim a multiple of 32) quantized to MX `element` with E8M0 scales rounded by `scale_rounding`.
    stats: `elements` and `clipped`, the elements beyond what rounds to max at their block scale
    (lab.formats.overflow_bound)."""
    blocks, scales = _quantize(x, k_dim, element, scale_rounding)
    values = blocks.reshape(blocks.shape[:-2] + (-1,)).movedim(-1, k_dim)
    if not stats:
        return Quantized(values)
    xf = x.detach().to(torch.float32)
    xb = xf.movedim(k_dim, -1).reshape(blocks.shape)
    clipped = xb.abs() > overflow_bound(element) * scales  # (max + ulp/2) * 2^p: exact; NaN compares False

    def as_x(t):  # (rows, blocks, 32) with k last -> x's shape
        return t.reshape(blocks.shape[:-2] + (-1,)).movedim(-1, k_dim)
    return Quantized(values, as_x(blocks / scales), as_x(clipped))  # / 2^p: exact

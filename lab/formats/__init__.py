"""Formats below 16 bits and their quantizers, in one place: FP8 (E4M3, E5M2) scaled per tensor, row, 1x128 tile or
128x128 block; MX (E8M0 block scales over E4M3, E5M2, E2M1 in 32-value blocks); NVFP4 (E2M1 in 16-value blocks,
E4M3 block scales, an FP32 tensor scale); stochastic rounding; the random Hadamard transform; and the accumulation
of a GEMM over quantized operands (FP32, or a Hopper tensor core's).

Every quantizer takes a high-precision tensor and the dimension its GEMM reduces over (``k_dim``: scales are shared
along it, a "row" is one index of the other dimension) and returns a `Quantized`: the dequantized values in FP32 (what
an emulated GEMM multiplies) and, when asked, how many elements were clipped at the format's maximum and how many
non-zero elements became zero. torchao's quantizers are used where it has a CPU path (its users' recipes); the lab's
own elsewhere, each checked against an FP64 reference of the format's specification (tests/test_formats*.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

#: element formats: torch dtype (None: no torch dtype), largest finite, smallest normal, smallest subnormal
ELEMENTS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m1": None,  # FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no torch dtype: torchao's and the lab's casts)
}
FP4_MAX = 6.0


def max_of(element: str) -> float:
    """The element format's largest finite value (torch.finfo where torch has the dtype)."""
    dtype = ELEMENTS[element]
    return FP4_MAX if dtype is None else float(torch.finfo(dtype).max)


def overflow_bound(element: str) -> float:
    """The largest magnitude that rounds to the format's maximum (max + half an ulp at the top binade): above it a
    value is clipped (saturating) or overflows; between the maximum and it, rounding alone brings it to the maximum
    and nothing is lost to the range. What every quantizer's `saturated` count counts."""
    top = max_of(element)
    mant = 1 if ELEMENTS[element] is None else -math.log2(torch.finfo(ELEMENTS[element]).eps)
    return top + 2.0 ** (math.floor(math.log2(top)) - mant) / 2


class Quantized(NamedTuple):
    """A quantized tensor as a GEMM sees it: `values`, the dequantized elements in FP32 (x's shape); with stats,
    `saturated` (elements whose scaled magnitude exceeded the format's maximum: clipped, or inf where the cast does
    not saturate) and `flushed` (non-zero elements that became zero), each a 0-d int64 tensor (no host sync)."""
    values: torch.Tensor
    saturated: torch.Tensor | None = None
    flushed: torch.Tensor | None = None


@dataclass(frozen=True)
class OperandFormat:
    """How one GEMM operand is quantized.

    element: e4m3 | e5m2 | e2m1.
    granularity: tensor | row (one scale per index of the non-k dimension) | tile (1x128 along k) |
        block (128x128) | mx (32 along k, E8M0 scale) | nvfp4 (16 along k, E4M3 scale, FP32 tensor scale) |
        nvfp4-2d (16x16 blocks).
    scale: current (the tensor's own amax now) | delayed (an amax history: the recipe keeps it) | pow2 (current,
        rounded down to a power of two: torchao rowwise) | one (no scale: FP8 as FP16 without a loss scale);
        mx scale rounding: floor (the OCP spec) | ceil | rceil | even.
    saturate: clip at the format's maximum (torchao, MX, NVFP4) or let the cast overflow to NaN/inf.
    stochastic: stochastic rounding of the elements (NVFP4's gradients).
    hadamard: a random Hadamard transform along k before quantizing (NVFP4's weight-gradient GEMM).
    """
    element: str = "e4m3"
    granularity: str = "tensor"
    scale: str = "current"
    saturate: bool = True
    stochastic: bool = False
    hadamard: bool = False


def quantize(x: torch.Tensor, fmt: OperandFormat, k_dim: int, *, history_amax: torch.Tensor | None = None,
             margin: int = 0, generator: torch.Generator | None = None, stats: bool = False) -> Quantized:
    """x (2-D) quantized as `fmt` says, its scales shared along `k_dim`; dequantized to FP32. Delayed scaling takes
    the amax its scale comes from (`history_amax`, the recipe's history) and `margin`; stochastic rounding draws
    from `generator`."""
    if fmt.granularity in ("tensor", "row", "tile", "block"):
        from lab.formats import scaled
        if fmt.scale == "delayed":
            if history_amax is None:
                raise ValueError("delayed scaling needs the amax history's value (history_amax)")
            amax = history_amax
        else:
            amax = scaled.amax_of(x, fmt.granularity, k_dim)
        scale = scaled.scale_from_amax(amax, fmt.element, fmt.scale, margin)
        if fmt.stochastic:
            from lab.formats.rounding import stochastic_round
            s = x.to(torch.float32) * scale
            values = stochastic_round(s, fmt.element, generator) / scale
            if not stats:
                return Quantized(values)
            return Quantized(values, (s.abs() > overflow_bound(fmt.element)).sum(), ((x != 0) & (values == 0)).sum())
        return scaled.quantize_scaled(x, fmt.element, fmt.granularity, k_dim, scale, fmt.saturate, stats)
    if fmt.granularity == "mx":
        from lab.formats.mx import quantize_mx
        return quantize_mx(x, k_dim, fmt.element, fmt.scale, stats=stats)
    if fmt.granularity in ("nvfp4", "nvfp4-2d"):
        from lab.formats.nvfp4 import quantize_nvfp4
        return quantize_nvfp4(x, k_dim, two_d=fmt.granularity == "nvfp4-2d", stochastic=fmt.stochastic,
                              generator=generator, stats=stats)
    raise ValueError(f"unknown granularity {fmt.granularity!r}: tensor, row, tile, block, mx, nvfp4, nvfp4-2d")

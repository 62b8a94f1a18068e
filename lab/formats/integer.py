"""Symmetric integer formats: INT8 per row (vLLM's and FlashRL's W8A8: one scale per output channel of a weight,
per token of an activation) and INT4 per group along k (GPTQ/AWQ-style W4A16 weights).

The quantizer is torchao's affine quantization (`choose_qparams_affine`, `quantize_affine`, `dequantize_affine`,
MappingType.SYMMETRIC): the lab's QAT runs the same arithmetic (lab/models/qat.py, torchao's fake quantizers). Its
rule, as torchao states it: scale = amax / ((q_max - q_min) / 2) (127.5 for INT8, 7.5 for INT4) clamped below at
FP32's smallest normal, zero point 0, elements round(x / scale) clipped to [q_min, q_max], dequantized as
elements * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.core.errors import ConfigError
from lab.formats.elements import Quantized

INT_BITS = (8, 4)
INT_GRANULARITIES = ("row", "group")


@dataclass(frozen=True)
class IntFormat:
    """A symmetric integer operand: ``bits`` 8 or 4; ``granularity`` row (one scale per index of the non-k
    dimension) or group (``group`` values along k share one)."""
    bits: int = 8
    granularity: str = "row"
    group: int = 128

    def __post_init__(self):
        if self.bits not in INT_BITS:
            raise ConfigError(f"integer bits must be one of {INT_BITS}, got {self.bits!r}")
        if self.granularity not in INT_GRANULARITIES:
            raise ConfigError(f"integer granularity must be one of {', '.join(INT_GRANULARITIES)}, got "
                              f"{self.granularity!r}")
        if type(self.group) is not int or self.group < 1:
            raise ConfigError(f"integer group must be a positive int, got {self.group!r}")

    @property
    def q_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


def quantize_int(x: torch.Tensor, fmt: IntFormat, k_dim: int, stats: bool = False) -> Quantized:
    """2-D x quantized as ``fmt`` says, its scales shared along ``k_dim``; dequantized to FP32 (torchao's)."""
    from torchao.quantization.quant_primitives import (MappingType, choose_qparams_affine, dequantize_affine,
                                                       quantize_affine)
    if x.dim() != 2:
        raise ValueError(f"quantize_int takes a 2-D tensor, got shape {tuple(x.shape)}")
    k = x.shape[k_dim]
    along = k if fmt.granularity == "row" else fmt.group
    if k % along:
        raise ValueError(f"integer groups are {along} values along k: dimension {k_dim} of shape {tuple(x.shape)} "
                         f"is not a multiple")
    block = [1, 1]
    block[k_dim] = along
    x32 = x.detach().to(torch.float32)
    q_min, q_max = fmt.q_range
    scale, zero = choose_qparams_affine(x32, MappingType.SYMMETRIC, block, torch.int8, q_min, q_max,
                                        eps=torch.finfo(torch.float32).tiny, scale_dtype=torch.float32)
    q = quantize_affine(x32, block, scale, zero, torch.int8, q_min, q_max)
    values = dequantize_affine(q, block, scale, zero, torch.int8, q_min, q_max, output_dtype=torch.float32)
    return Quantized(values, q.float() if stats else None)

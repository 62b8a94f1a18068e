"""Formats below 16 bits and their quantizers, in one place: FP8 (E4M3, E5M2) scaled per tensor, row, 1x128 tile or
128x128 block; MX (E8M0 block scales over E4M3, E5M2, E2M1 in 32-value blocks); NVFP4 (E2M1 in 16-value blocks, E4M3
block scales, an FP32 tensor scale); symmetric INT8 per row and INT4 per group (torchao's affine quantization,
lab/formats/integer.py); stochastic rounding; the random Hadamard transform; and the accumulation of a GEMM over
quantized operands (FP32, or a Hopper tensor core's).

Every quantizer takes a high-precision tensor and the dimension its GEMM reduces over (``k_dim``: scales are shared
along it, a "row" is one index of the other dimension; `quantize` also takes a (B, T, C) operand, reduced along C as
its 2-D reshape) and returns a `Quantized`: the dequantized values in FP32
(what an emulated GEMM multiplies) and, when asked, its elements on the format's grid and which were clipped at the
format's maximum (what the FP8 census counts, lab/fp8/census.py). torchao's quantizers are used where it has a CPU
path (its users' recipes); the lab's own elsewhere, each checked against an FP64 reference of the format's
specification (tests/test_formats*.py). The block-scaled quantizers (MX, NVFP4) run as fused kernels on the CPU
where they give their eager steps' bits (lab/formats/kernels.py).
"""
from lab.formats.elements import ELEMENTS, FP4_MAX, OperandFormat, Quantized, max_of, overflow_bound
from lab.formats.integer import IntFormat
from lab.formats.quantize import quantize

__all__ = ["ELEMENTS", "FP4_MAX", "IntFormat", "OperandFormat", "Quantized", "max_of", "overflow_bound", "quantize"]

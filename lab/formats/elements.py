"""The element formats below 16 bits, what a quantizer returns (`Quantized`) and how an operand is quantized
(`OperandFormat`): the types every module of lab/formats shares."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lab.core.errors import ConfigError, did_you_mean

#: element formats: torch dtype (None: no torch dtype), largest finite, smallest normal, smallest subnormal
ELEMENTS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m1": None,  # FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no torch dtype: torchao's and the lab's casts)
}
FP4_MAX = 6.0
#: granularities whose FP8 scale follows a rule (OperandFormat.scale), and the block-scaled formats, whose scales
#: are each block's own amax now
SCALED = ("tensor", "row", "tile", "block")
BLOCK_SCALED = ("mx", "nvfp4", "nvfp4-2d")
SCALE_RULES = ("current", "delayed", "pow2", "one")
#: MX's E8M0 scale rounding: floor (OCP MX v1.0), ceil, rceil (NVIDIA's: no element clips), even
MX_ROUNDINGS = ("floor", "ceil", "rceil", "even")


def max_of(element: str) -> float:
    """The element format's largest finite value (torch.finfo where torch has the dtype)."""
    dtype = ELEMENTS[element]
    return FP4_MAX if dtype is None else float(torch.finfo(dtype).max)


def overflow_bound(element: str) -> float:
    """The largest magnitude that rounds to the format's maximum (max + half an ulp at the top binade): above it a
    value is clipped (saturating) or overflows; between the maximum and it, rounding alone brings it to the maximum
    and nothing is lost to the range. What every quantizer's `clipped` mask marks."""
    top = max_of(element)
    mant = 1 if ELEMENTS[element] is None else -math.log2(torch.finfo(ELEMENTS[element]).eps)
    return top + 2.0 ** (math.floor(math.log2(top)) - mant) / 2


class Quantized(NamedTuple):
    """A quantized tensor as a GEMM sees it: `values`, the dequantized elements in FP32 (x's shape); with stats, in
    x's shape, `elements` (the values on the element format's grid, before dequantization: FP32) and `clipped`
    (elements whose scaled magnitude exceeded what rounds to the format's maximum: clipped, or inf where the cast
    does not saturate): what the FP8 census (lab/fp8/census.py) counts, per operand and per block, with the
    elements flushed (non-zero in x, zero in values). `amax`: where the quantizer read x's own magnitudes (current
    scaling per tensor, row, tile or block), the amaxes its scales came from, in any shape (one per tensor, row, tile
    or block): their maximum is x's largest magnitude, which a recorder reads here instead of reading x again;
    None where it did not (delayed scaling's scale comes from a history, MX and NVFP4 keep theirs)."""
    values: torch.Tensor
    elements: torch.Tensor | None = None
    clipped: torch.Tensor | None = None
    amax: torch.Tensor | None = None


@dataclass(frozen=True)
class OperandFormat:
    """How one GEMM operand is quantized.

    element: e4m3 | e5m2 | e2m1.
    granularity: tensor | row (one scale per index of the non-k dimension) | tile (1x128 along k) |
        block (128x128) | mx (32 along k, E8M0 scale) | nvfp4 (16 along k, E4M3 scale, FP32 tensor scale) |
        nvfp4-2d (16x16 blocks).
    scale: per tensor, row, tile or block: current (the tensor's own amax now) | delayed (an amax history: the
        recipe keeps it) | pow2 (current, rounded down to a power of two: torchao rowwise) | one (no scale: FP8 as
        FP16 without a loss scale); MX and NVFP4: current only (each block's own amax).
    scale_rounding: MX only, its E8M0 scales' rounding: floor (OCP MX v1.0, the default) | ceil | rceil (NVIDIA's)
        | even.
    saturate: clip at the format's maximum (torchao, MX, NVFP4) or let the cast overflow to NaN/inf (per tensor,
        row, tile or block only: MX and NVFP4 always clip).
    stochastic: stochastic rounding of the elements (NVFP4's gradients; not MX's quantizer).
    hadamard: a random Hadamard transform along k before quantizing (NVFP4's weight-gradient GEMM).
    amax_floor: the smallest amax a scale is computed from (FP8 per tensor, row, tile, block): torchao's EPS 1e-12;
        0 is torchao before pytorch/ao#3356's fix, where an all-zero row's scale is infinite and its values NaN.
    """
    element: str = "e4m3"
    granularity: str = "tensor"
    scale: str = "current"
    scale_rounding: str | None = None  # None: MX's default (floor); any other format takes none
    saturate: bool = True
    stochastic: bool = False
    hadamard: bool = False
    amax_floor: float = 1e-12

    def __post_init__(self):
        # a setting the format's quantizer would ignore is refused: it would be read as applied and is not
        _one_of("element", self.element, tuple(ELEMENTS))
        _one_of("granularity", self.granularity, SCALED + BLOCK_SCALED)
        if self.granularity == "mx":
            object.__setattr__(self, "scale_rounding", self.scale_rounding or "floor")  # equal to an explicit floor
            _one_of("scale_rounding", self.scale_rounding, MX_ROUNDINGS)
        elif self.scale_rounding is not None:
            raise self._ignored("scale_rounding", "MX's alone: the rounding of its E8M0 scales")
        if self.granularity in SCALED:
            _one_of("scale", self.scale, SCALE_RULES)
            _one_of("element", self.element, ("e4m3", "e5m2"), f"{self.granularity} scaling is FP8")
            return
        _one_of("scale", self.scale, ("current",), f"{self.granularity}'s scales are each block's own amax" +
                (" (MX's E8M0 rounding is scale_rounding)" if self.scale in MX_ROUNDINGS else ""))
        if self.granularity != "mx":
            _one_of("element", self.element, ("e2m1",), "NVFP4's elements are E2M1")
        fixed = {"saturate": True, "amax_floor": 1e-12, **({"stochastic": False} if self.granularity == "mx" else {})}
        for name, only in fixed.items():
            if getattr(self, name) != only:
                raise self._ignored(name, f"it takes {only!r} only")

    def _ignored(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"{self.granularity} quantization ignores {name} ({why}), got {getattr(self, name)!r}")


def _one_of(name: str, value, allowed: tuple, why: str = "") -> None:
    if value not in allowed:
        choices = allowed[0] if len(allowed) == 1 else "one of " + ", ".join(allowed)
        raise ConfigError(f"{name} must be {choices}, got {value!r}{did_you_mean(value, allowed)}"
                          f"{': ' + why if why else ''}")


_DECODE: dict = {}


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's values in FP32, exactly as `q.float()` (NaN included), by table lookup: torch's own conversion
    of all 256 codes, looked up by byte. The CPU's elementwise E4M3 conversion is a slow scalar path (~7x the lookup
    on a 2-core EPYC), and it runs on every operand of every emulated GEMM."""
    table = _DECODE.get((q.dtype, q.device))
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(q.dtype)
        table = _DECODE[(q.dtype, q.device)] = codes.float().to(q.device)
    return table.index_select(0, q.reshape(-1).view(torch.uint8).int()).view(q.shape)

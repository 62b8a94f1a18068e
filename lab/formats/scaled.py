"""FP8 (E4M3, E5M2) with a scale per tensor, per row, per 1x128 tile or per 128x128 block.

The arithmetic is torchao's float8 training cast, step for step, so that the lab's tensorwise and rowwise GEMMs equal
torchao's `Float8Linear(emulate=True)` bit for bit (tests/test_fp8_linear.py): the amax in the tensor's dtype, the
scale fp8_max / max(amax, 1e-12) computed in FP64 and rounded once to FP32 (torchao's `amax_to_scale`), optionally
rounded down to a power of two (its rowwise recipe); the elements `x.float() * scale`, clipped at the format's
maximum, cast to FP8 (round to nearest even); dequantized as `q.float() / scale`. A zero amax is clamped to 1e-12,
as torchao does (pytorch/ao#3356: without the bound an all-zero row gets an infinite scale and NaN).

Tiles and blocks (DeepSeek-V3: activations and gradients per 1x128 tile along the GEMM's reduction dimension, weights
per 128x128 block) use the same per-scale arithmetic. A dimension that is not a multiple of 128 ends in a short tile
(zeros pad it for the amax only: they change no maximum).
"""
from __future__ import annotations

import torch

from lab.formats.elements import ELEMENTS, Quantized, fp8_to_float, overflow_bound

AMAX_FLOOR = 1e-12  # torchao's EPS: the smallest amax a scale is computed from
TILE = 128
# does this torch's cast to each FP8 format saturate (values beyond the maximum, inf included, become the maximum)?
# Asked once per format, not assumed: torch 2.14's eager cast saturates to E4M3 but overflows to inf in E5M2
SATURATING_CAST = {e: bool(torch.tensor([1e6, float("inf")]).to(ELEMENTS[e]).float().eq(float(torch.finfo(
    ELEMENTS[e]).max)).all()) for e in ("e4m3", "e5m2")}


def fp8_max(element: str) -> float:
    return float(torch.finfo(ELEMENTS[element]).max)


def scale_from_amax(amax: torch.Tensor, element: str, rule: str = "current", margin: int = 0) -> torch.Tensor:
    """FP32 scale(s) mapping amax onto the format's maximum, as torchao's amax_to_scale computes them (FP64, one
    rounding to FP32). pow2: rounded down to a power of two (torchao rowwise); delayed: divided by 2^margin
    (Transformer Engine), and 1 where the history holds no amax yet (TE's initial scale)."""
    if rule == "one":
        return torch.ones_like(amax, dtype=torch.float32)
    scale = (fp8_max(element) / torch.clamp(amax.to(torch.float64), min=AMAX_FLOOR)).to(torch.float32)
    if rule == "pow2":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    elif rule == "delayed":
        scale = torch.where(amax > 0, scale / 2.0 ** margin, torch.ones_like(scale))
    return scale


def _tiles(x: torch.Tensor, k_dim: int, size: int) -> tuple[torch.Tensor, int]:
    """x (2-D) as (rows, tiles, size) with k last, zero-padded to whole tiles; and k's length before padding."""
    t = x if k_dim == 1 else x.t()
    k = t.shape[1]
    pad = (-k) % size
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(t.shape[0], -1, size), k


def amax_of(x: torch.Tensor, granularity: str, k_dim: int) -> torch.Tensor:
    """The amax each scale is computed from, broadcastable against x (tile and block: x's shape, repeated)."""
    if granularity == "tensor":  # max(-min, max): one pass over x, no |x| allocated (the same value as max(|x|))
        low, high = torch.aminmax(x)
        return torch.maximum(-low, high)
    if granularity == "row":
        low, high = torch.aminmax(x, dim=k_dim, keepdim=True)
        return torch.maximum(-low, high)
    a = x.abs()
    if granularity == "tile":
        tiles, k = _tiles(a, k_dim, TILE)
        per = torch.amax(tiles, dim=2, keepdim=True).expand_as(tiles).reshape(tiles.shape[0], -1)[:, :k]
        return per if k_dim == 1 else per.t()
    if granularity == "block":
        rows, cols = a.shape
        pad = torch.nn.functional.pad(a, (0, (-cols) % TILE, 0, (-rows) % TILE))
        r, c = pad.shape[0] // TILE, pad.shape[1] // TILE
        per = torch.amax(pad.reshape(r, TILE, c, TILE), dim=(1, 3), keepdim=True)
        return per.expand(r, TILE, c, TILE).reshape(pad.shape)[:rows, :cols]
    raise ValueError(f"unknown FP8 granularity {granularity!r}: tensor, row, tile or block")


def cast(scaled: torch.Tensor, element: str, saturate: bool = True) -> torch.Tensor:
    """Round FP32 values (already scaled) to the FP8 format. Saturating: clipped at the maximum (torchao, MX);
    otherwise a value that rounds beyond the maximum overflows: inf in E5M2, NaN in E4M3 (which has no inf)."""
    top = fp8_max(element)
    if saturate:  # where torch's cast saturates, torchao's clamp first gives the same bits: one pass saved
        fp8 = ELEMENTS[element]
        return scaled.to(fp8) if SATURATING_CAST[element] else scaled.clamp(-top, top).to(fp8)
    q = scaled.clamp(-top, top).to(ELEMENTS[element])
    overflow = scaled.abs() > overflow_bound(element)
    bad = float("inf") if element == "e5m2" else float("nan")
    return torch.where(overflow, torch.copysign(torch.full_like(scaled, bad), scaled), q.float()).to(q.dtype)


def quantize_scaled(x: torch.Tensor, element: str, granularity: str, k_dim: int, scale: torch.Tensor,
                    saturate: bool = True, stats: bool = False) -> Quantized:
    """x quantized at the given scale(s) and dequantized to FP32, torchao's arithmetic."""
    scaled = x.to(torch.float32) * scale
    values = fp8_to_float(cast(scaled, element, saturate)) / scale  # torchao's q.float() / scale, bit for bit
    if not stats:
        return Quantized(values)
    saturated = (scaled.abs() > overflow_bound(element)).sum()
    flushed = ((x != 0) & (values == 0)).sum()
    return Quantized(values, saturated, flushed)

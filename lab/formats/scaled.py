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


def scale_from_amax(amax: torch.Tensor, element: str, rule: str = "current", margin: int = 0,
                    floor: float = AMAX_FLOOR) -> torch.Tensor:
    """FP32 scale(s) mapping amax onto the format's maximum, as torchao's amax_to_scale computes them (FP64, one
    rounding to FP32). pow2: rounded down to a power of two (torchao rowwise); delayed: divided by 2^margin
    (Transformer Engine), and 1 where the history holds no amax yet (TE's initial scale)."""
    if rule == "one":
        return torch.ones_like(amax, dtype=torch.float32)
    scale = (fp8_max(element) / torch.clamp(amax.to(torch.float64), min=floor)).to(torch.float32)
    if rule == "pow2":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    elif rule == "delayed":
        scale = torch.where(amax > 0, scale / 2.0 ** margin, torch.ones_like(scale))
    return scale


def delayed_amax(predicted: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The amax a delayed scale comes from: the prediction where it is finite and positive, else ``previous``, the
    one the scale in use came from (0 before any: scale 1). Transformer Engine's rule (delayed_scaling.cu: a new
    scale ``max / amax`` only from a finite, positive amax, else the scale kept), held as the amax rather than the
    scale, which is a function of it (scale_from_amax)."""
    return torch.where(torch.isfinite(predicted) & (predicted > 0), predicted, previous)


def _split(n: int) -> tuple[int, int]:
    """A dimension of length n as (tiles, tile length): one short tile when n <= 128 (n a multiple otherwise)."""
    return (1, n) if n <= TILE else (n // TILE, TILE)


def blocks(x: torch.Tensor, granularity: str, k_dim: int) -> torch.Tensor:
    """x viewed with each tile (1x128 along k) or block (128x128) on dimensions of its own, so that one scale per
    tile broadcasts against it (no per-element scale tensor): tile (rows, tiles, 128) for k_dim 1, (tiles, 128,
    rows) for k_dim 0; block (row blocks, 128, column blocks, 128). A dimension that is not whole tiles is padded
    with zeros (they change no amax, saturate nothing, flush nothing); `unblock` undoes both. Tensor, row: x."""
    if granularity not in ("tile", "block"):
        return x
    dims = (k_dim,) if granularity == "tile" else (0, 1)
    pad = [0, 0, 0, 0]
    for d in dims:
        n = x.shape[d]
        pad[2 * (1 - d) + 1] = 0 if n <= TILE else (-n) % TILE
    if any(pad):
        x = torch.nn.functional.pad(x, pad)
    for d in sorted(dims, reverse=True):  # the later dimension first: the earlier keeps its index
        x = x.unflatten(d, _split(x.shape[d]))
    return x


def unblock(values: torch.Tensor, granularity: str, k_dim: int, shape: torch.Size) -> torch.Tensor:
    """blocks' view undone: values in x's shape (any padding cut off)."""
    if granularity == "tile":
        values = values.flatten(k_dim, k_dim + 1)
    elif granularity == "block":
        values = values.flatten(2, 3).flatten(0, 1)
    return values if values.shape == shape else values[:shape[0], :shape[1]]


def amax_of(x: torch.Tensor, granularity: str, k_dim: int) -> torch.Tensor:
    """The amax each scale is computed from, broadcastable against x (tile and block: against blocks(x))."""
    if granularity == "tensor":  # max(-min, max): one pass over x, no |x| allocated (the same value as max(|x|))
        low, high = torch.aminmax(x)
        return torch.maximum(-low, high)
    if granularity == "row":  # amin and amax: torch's aminmax along a dimension is ~10x slower on the CPU
        return torch.maximum(-x.amin(dim=k_dim, keepdim=True), x.amax(dim=k_dim, keepdim=True))
    if granularity == "tile":
        return x.abs().amax(dim=k_dim + 1, keepdim=True)  # the tile's 128 values: dimension 2 (k_dim 1) or 1 (0)
    if granularity == "block":
        return x.abs().amax(dim=(1, 3), keepdim=True)
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


def quantize_scaled(x: torch.Tensor, element: str, scale: torch.Tensor, saturate: bool = True,
                    stats: bool = False) -> Quantized:
    """x quantized at the given scale(s) (broadcast against it) and dequantized to FP32, torchao's arithmetic."""
    scaled = x.to(torch.float32) * scale
    elements = fp8_to_float(cast(scaled, element, saturate))
    values = elements / scale  # torchao's q.float() / scale, bit for bit
    if not stats:
        return Quantized(values)
    return Quantized(values, elements, scaled.abs() > overflow_bound(element))

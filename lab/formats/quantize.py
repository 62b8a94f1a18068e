"""The one entry point to the quantizers: an operand quantized as its OperandFormat (or IntFormat,
lab/formats/integer.py) says (lab/formats/__init__.py)."""
from __future__ import annotations

import torch

from lab.core.errors import ConfigError
from lab.formats import scaled
from lab.formats.elements import SCALED, OperandFormat, Quantized, overflow_bound
from lab.formats.integer import IntFormat, quantize_int
from lab.formats.rounding import stochastic_round


def quantize(x: torch.Tensor, fmt: OperandFormat | IntFormat, k_dim: int, *, history_amax: torch.Tensor | None = None,
             margin: int = 0, generator: torch.Generator | None = None, stats: bool = False,
             tensor_scale: torch.Tensor | float | None = None) -> Quantized:
    """x quantized as `fmt` says, its scales shared along `k_dim`; dequantized to FP32. A 2-D x reduces along
    either dimension; any other (activations (B, T, C)) along its last (k_dim -1), as its 2-D reshape (leading
    dimensions flattened) would, the results in x's shape. Delayed scaling takes the amax its scale comes from
    (`history_amax`, the recipe's history) and `margin`; stochastic rounding draws from `generator`; NVFP4 takes
    its FP32 tensor scale (`tensor_scale`, torchao's per_tensor_scale: amax / (448 * 6)), or computes it from x."""
    if tensor_scale is not None and getattr(fmt, "granularity", None) not in ("nvfp4", "nvfp4-2d"):
        raise ConfigError(f"tensor_scale is NVFP4's FP32 tensor scale: {fmt.granularity} quantization ignores it")
    x2, k2 = _as_2d(x, k_dim)
    # one emulated hardware operation: a torch function mode (the lab's CPU contract, lab/numerics/contract.py) has
    # nothing to change in its elementwise steps and would intercept each of its ~30 torch calls (~2x its fixed cost)
    with torch._C.DisableTorchFunction():
        q = (quantize_int(x2, fmt, k2, stats) if isinstance(fmt, IntFormat)
             else _quantize(x2, fmt, k2, history_amax, margin, generator, stats, tensor_scale))
    if x2 is x:
        return q
    return q._replace(**{f: getattr(q, f).reshape(x.shape) for f in ("values", "elements", "clipped")
                         if getattr(q, f) is not None})


def _as_2d(x: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, int]:
    """x as the 2-D operand its quantizers take, and its k_dim there (0 or 1)."""
    last = x.dim() - 1
    if x.dim() == 2 and k_dim in (-2, -1, 0, 1):
        return x, k_dim % 2
    if x.dim() == 0 or k_dim not in (-1, last):
        raise ValueError(f"a {x.dim()}-D operand (shape {tuple(x.shape)}) is quantized along its last dimension "
                         f"(k_dim -1 or {last}), got k_dim {k_dim}")
    return x.reshape(-1, x.shape[-1]), 1  # blocks run along C, rows over the leading dimensions


def _quantize(x, fmt, k_dim, history_amax, margin, generator, stats, tensor_scale) -> Quantized:
    if fmt.granularity in SCALED:
        return _quantize_scaled(x, fmt, k_dim, history_amax, margin, generator, stats)
    if fmt.granularity == "mx":
        from lab.formats.mx import quantize_mx  # torchao: imported by the recipes that use it
        return quantize_mx(x, k_dim, fmt.element, fmt.scale_rounding, stats=stats)
    from lab.formats.nvfp4 import quantize_nvfp4  # OperandFormat admits no other granularity
    return quantize_nvfp4(x, k_dim, two_d=fmt.granularity == "nvfp4-2d", stochastic=fmt.stochastic,
                          generator=generator, stats=stats, tensor_scale=tensor_scale)


def _quantize_scaled(x, fmt, k_dim, history_amax, margin, generator, stats) -> Quantized:
    """FP8 with a scale per tensor, row, tile or block: computed on x viewed as blocks (scale.blocks), so that one
    scale per tile broadcasts, no scale per element."""
    if not fmt.stochastic and not x.is_contiguous() and x.t().is_contiguous():
        # a transposed view (w^T, go^T): its transpose's quantization along the other dimension, transposed back,
        # the same bits (every step elementwise given the exact amax) at a third of the cost for tiles and blocks
        # (their views of a transposed tensor are strided); stochastic rounding draws in x's own order
        q = _quantize_scaled(x.t(), fmt, 1 - k_dim, history_amax, margin, generator, stats)
        return q._replace(**{f: getattr(q, f).t() for f in ("values", "elements", "clipped")
                             if getattr(q, f) is not None})
    g = fmt.granularity
    xb = scaled.blocks(x, g, k_dim)
    if fmt.scale == "delayed":
        if history_amax is None:
            raise ValueError("delayed scaling needs the amax history's value (history_amax)")
        amax = history_amax
    else:
        amax = scaled.amax_of(xb, g, k_dim)
    scale = scaled.scale_from_amax(amax, fmt.element, fmt.scale, margin, fmt.amax_floor)
    own = None if fmt.scale == "delayed" else amax  # x's own amaxes, read already: a recorder's (Quantized.amax)
    if not fmt.stochastic:
        q = scaled.quantize_scaled(xb, fmt.element, scale, fmt.saturate, stats)
        if not stats:
            return q._replace(values=scaled.unblock(q.values, g, k_dim, x.shape), amax=own)
        return q._replace(amax=own, **{f: scaled.unblock(getattr(q, f), g, k_dim, x.shape)
                                       for f in ("values", "elements", "clipped")})
    s = xb.to(torch.float32) * scale
    # drawn in x's shape: one draw per element of x, in its order (the blocks' padding draws none)
    rounded = stochastic_round(scaled.unblock(s, g, k_dim, x.shape), fmt.element, generator)
    values = scaled.unblock(scaled.blocks(rounded, g, k_dim) / scale, g, k_dim, x.shape)
    if not stats:
        return Quantized(values, amax=own)
    return Quantized(values, rounded, scaled.unblock(s.abs() > overflow_bound(fmt.element), g, k_dim, x.shape), own)

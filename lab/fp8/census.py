"""The FP8 census: what quantization did to each quantized operand of each linear on census steps, for the lab's
recipes (RecipeLinear) and for torchao's float8 training (`Float8Linear`, through module hooks).

One row per (step, layer, GEMM, role): the operand's amax (and delayed scaling's history amax: the lag), the range of
its scales, and its elements' fate: saturated (clipped at the format's maximum), flushed (non-zero, quantized to zero),
subnormal (kept with fewer significant bits than the format's normals: precision lost, not only values), the relative
quantization error ||q - x|| / ||x||, and per scaling block (a tensor, a row, a 1x128 tile, a 128x128 block, an MX or
NVFP4 block) the share of blocks with a clipped element, the all-zero blocks (an amax of 0: without a lower bound on
the amax, an infinite scale and NaN values, counted as non-finite) and the worst block's relative error.

Host synchronisation: none on ordinary steps (the census is off); on a census step the rows stay on the device until
`take()`, which fetches all of them in one transfer.
"""
from __future__ import annotations

import math

import torch

from lab.formats import OperandFormat, Quantized
from lab.formats.elements import ELEMENTS

COLUMNS = ("step", "layer", "gemm", "role", "element", "granularity", "scale_rule", "numel", "nonzero", "amax",
           "history_amax", "scale_min", "scale_max", "saturated", "flushed", "subnormal", "nonfinite", "rel_error",
           "blocks", "blocks_clipped", "zero_blocks", "worst_block_error")
NUMBERS = COLUMNS[7:]  # what operand_stats computes, in this order
#: scaling block (rows, k) of each granularity; None: the whole dimension (a tensor, a row)
BLOCK = {"tensor": (None, None), "row": (1, None), "tile": (1, 128), "block": (128, 128), "mx": (1, 32),
         "nvfp4": (1, 16), "nvfp4-2d": (16, 16)}


def smallest_normal(element: str) -> float:
    """The element format's smallest normal magnitude (E2M1: 1.0, its one subnormal is 0.5)."""
    dtype = ELEMENTS[element]
    return 1.0 if dtype is None else float(torch.finfo(dtype).smallest_normal)


def _blocks(x: torch.Tensor, k_dim: int, granularity: str) -> torch.Tensor:
    """x (2-D) as (blocks, values per block) in the granularity's scaling blocks, k last; zero-padded to whole blocks
    (zeros clip nothing and add nothing to an error)."""
    rows, cols = BLOCK[granularity]
    xk = x if k_dim == 1 else x.t()
    m, k = xk.shape
    rows, cols = rows or m, cols or k
    if granularity == "tensor":
        rows = m
    xk = torch.nn.functional.pad(xk, (0, (-k) % cols, 0, (-m) % rows))
    mb, kb = xk.shape[0] // rows, xk.shape[1] // cols
    return xk.reshape(mb, rows, kb, cols).permute(0, 2, 1, 3).reshape(mb * kb, rows * cols)


@torch.no_grad()
def operand_stats(x: torch.Tensor, q: Quantized, fmt: OperandFormat, k_dim: int,
                  history_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The census numbers (NUMBERS) of one quantized operand, an FP64 tensor on x's device (no host sync). `q` must
    come from `quantize(..., stats=True)` (its `elements` and `clipped`)."""
    if q.elements is None or q.clipped is None:
        raise ValueError("operand_stats needs a quantization with stats=True (elements and clipped)")
    xf = x.detach().to(torch.float32)
    err = (q.values - xf).double()
    nonzero = (xf != 0)
    mag = q.elements.abs()
    subnormal = (mag > 0) & (mag < smallest_normal(fmt.element))
    # each element's scale, what multiplies it into the format: elements / values (the dequantization divided or
    # multiplied by it, rounded once: exact to an ulp), where the element is non-zero
    keep = (q.elements != 0) & q.values.isfinite() & (q.values != 0)
    scale = torch.where(keep, q.elements / q.values, torch.full_like(xf, math.nan)).abs()
    scale = scale[~scale.isnan()]
    clipped_b = _blocks(q.clipped.to(torch.float32), k_dim, fmt.granularity).amax(dim=1)
    zero_b = _blocks(nonzero.to(torch.float32), k_dim, fmt.granularity).amax(dim=1) == 0  # all-zero: amax 0
    err_b = _blocks(err, k_dim, fmt.granularity).square().sum(dim=1)
    ref_b = _blocks(xf.double(), k_dim, fmt.granularity).square().sum(dim=1)
    worst = torch.where(ref_b > 0, err_b / ref_b, torch.zeros_like(ref_b)).max().sqrt()
    nan = torch.tensor(math.nan, dtype=torch.float64, device=x.device)
    amax = xf.abs().max().double() if xf.numel() else nan
    return torch.stack([
        torch.tensor(float(xf.numel()), dtype=torch.float64, device=x.device), nonzero.sum().double(), amax,
        nan if history_amax is None else history_amax.detach().double().reshape(()),
        scale.min().double() if scale.numel() else nan, scale.max().double() if scale.numel() else nan,
        q.clipped.sum().double(), (nonzero & (q.values == 0)).sum().double(), subnormal.sum().double(),
        (~q.values.isfinite()).sum().double(),
        (err.square().sum() / xf.double().square().sum().clamp_min(1e-300)).sqrt(),
        torch.tensor(float(clipped_b.numel()), dtype=torch.float64, device=x.device), clipped_b.sum().double(),
        zero_b.sum().double(), worst])


class Rows:
    """A census step's rows, kept on the device until `take()` (one transfer for all of them)."""

    def __init__(self):
        self.pending: list[tuple[dict, torch.Tensor]] = []

    def add(self, step: int, layer: str, gemm: str, role: str, fmt: OperandFormat, numbers: torch.Tensor) -> None:
        self.pending.append(({"step": step, "layer": layer, "gemm": gemm, "role": role, "element": fmt.element,
                              "granularity": fmt.granularity, "scale_rule": fmt.scale}, numbers))

    def take(self) -> list[dict]:
        if not self.pending:
            return []
        values = torch.stack([n.cpu() for _, n in self.pending]).tolist()
        out = [{**key, **dict(zip(NUMBERS, v))} for (key, _), v in zip(self.pending, values)]
        self.pending.clear()
        return out

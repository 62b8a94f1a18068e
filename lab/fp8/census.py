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

import csv
import math
from pathlib import Path

import torch

from lab.formats import OperandFormat, Quantized
from lab.formats.elements import ELEMENTS

FILE = "fp8_census.csv"
#: an operand's role in its GEMMs -> the tensor kind the tables and diagnoses report
KIND = {"input": "activation", "weight": "weight", "grad_output": "gradient"}
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


def count(mask: torch.Tensor) -> torch.Tensor:
    return torch.count_nonzero(mask).double()


def _view(x: torch.Tensor, k_dim: int, granularity: str) -> torch.Tensor:
    """x (2-D) viewed as (row blocks, rows, k blocks, cols) in the granularity's scaling blocks, k last; zero-padded
    to whole blocks (zeros clip nothing and add nothing to an error). A reduction over dimensions (1, 3) gives one
    value per block, with no copy where no padding is needed."""
    rows, cols = BLOCK[granularity]
    xk = x if k_dim == 1 else x.t()
    m, k = xk.shape
    rows, cols = rows or m, cols or k
    if (-k) % cols or (-m) % rows:
        xk = torch.nn.functional.pad(xk, (0, (-k) % cols, 0, (-m) % rows))
    return xk.reshape(xk.shape[0] // rows, rows, xk.shape[1] // cols, cols)


def _blocks(x: torch.Tensor, k_dim: int, granularity: str) -> torch.Tensor:
    """x as (blocks, values per block), each row one scaling block (a copy: for tests and the replay's checks)."""
    v = _view(x, k_dim, granularity)
    return v.permute(0, 2, 1, 3).reshape(v.shape[0] * v.shape[2], v.shape[1] * v.shape[3])


@torch.no_grad()
def operand_stats(x: torch.Tensor, q: Quantized, fmt: OperandFormat, k_dim: int,
                  history_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The census numbers (NUMBERS) of one quantized operand, an FP64 tensor on x's device (no host sync). `q` must
    come from `quantize(..., stats=True)` (its `elements` and `clipped`). FP32 throughout (a per-block sum's
    rounding is far below what these numbers are read for), counts by count_nonzero (no integer copies)."""
    if q.elements is None or q.clipped is None:
        raise ValueError("operand_stats needs a quantization with stats=True (elements and clipped)")
    f64 = torch.float64
    xf = x.detach().to(torch.float32)
    err2, ref2 = (q.values - xf).square(), xf.square()
    nonzero = xf != 0
    mag = q.elements.abs()
    # each element's scale, what multiplies it into the format: elements / values (the dequantization divided or
    # multiplied by it, rounded once: exact to an ulp), where the element is non-zero
    finite = q.values.isfinite()
    skip = ~((mag > 0) & finite & (q.values != 0))
    ratio = (q.elements / q.values).abs()
    nan = torch.tensor(math.nan, dtype=f64, device=x.device)
    # no element to read a scale from (an all-zero or all-flushed operand): NaN, not an infinity
    scale_min = ratio.masked_fill(skip, math.inf).amin().double()
    scale_max = ratio.masked_fill(skip, -math.inf).amax().double()
    scale_min, scale_max = (torch.where(torch.isfinite(v), v, nan) for v in (scale_min, scale_max))
    g = fmt.granularity
    clipped_b = _view(q.clipped, k_dim, g).amax(dim=(1, 3))
    zero_b = ~_view(nonzero, k_dim, g).amax(dim=(1, 3))  # all-zero: an amax of 0
    err_b = _view(err2, k_dim, g).sum(dim=(1, 3)).double()
    ref_b = _view(ref2, k_dim, g).sum(dim=(1, 3)).double()
    worst = torch.where(ref_b > 0, err_b / ref_b, torch.zeros_like(ref_b)).max().sqrt()
    amax = xf.abs().max().double() if xf.numel() else nan
    return torch.stack([
        torch.tensor(float(xf.numel()), dtype=f64, device=x.device), count(nonzero), amax,
        nan if history_amax is None else history_amax.detach().double().reshape(()), scale_min, scale_max,
        count(q.clipped), count(nonzero & (q.values == 0)), count((mag > 0) & (mag < smallest_normal(fmt.element))),
        count(~finite), (err_b.sum() / ref_b.sum().clamp_min(1e-300)).sqrt(),
        torch.tensor(float(clipped_b.numel()), dtype=f64, device=x.device), count(clipped_b), count(zero_b), worst])


_TEXT = ("layer", "gemm", "role", "element", "granularity", "scale_rule")
_COUNTS = ("step", "numel", "nonzero", "saturated", "flushed", "subnormal", "nonfinite", "blocks", "blocks_clipped",
           "zero_blocks")


def read_rows(run_dir) -> list[dict] | None:
    """A run's fp8_census.csv as rows (names as text, a layer "0" included; counts as ints; the rest floats, NaN where
    empty); None when the run has none."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in _COUNTS:
                r[k] = int(float(v))
            elif k not in _TEXT:
                r[k] = float(v) if v not in ("", None) else math.nan
    return rows


def forward_operands(recipe, x2: torch.Tensor, w: torch.Tensor) -> list[tuple]:
    """(gemm, role, tensor, format, k_dim) of the forward GEMM's quantized operands (output = x2 @ w^T), as
    lab/fp8/linear.py's GEMMs quantize them; an operand the recipe keeps in high precision is left out."""
    f = recipe.forward
    return [o for o in (("forward", "input", x2, f.a, 1), ("forward", "weight", w.t(), f.b, 0)) if o[3] is not None]


def backward_operands(recipe, go: torch.Tensor, w: torch.Tensor, x2: torch.Tensor | None) -> list[tuple]:
    """The two gradient GEMMs' operands (grad_input = go @ w, grad_weight = go^T @ x2; without x2, the latter's input
    is left out)."""
    gi, gw = recipe.grad_input, recipe.grad_weight
    ops = [("grad_input", "grad_output", go, gi.a, 1), ("grad_input", "weight", w, gi.b, 0),
           ("grad_weight", "grad_output", go.t(), gw.a, 1)]
    if x2 is not None:
        ops.append(("grad_weight", "input", x2, gw.b, 0))
    return [o for o in ops if o[3] is not None]


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

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
from pathlib import Path

import torch

from lab.core import runfiles
from lab.formats import OperandFormat, Quantized
from lab.formats.elements import ELEMENTS
from lab.formats.kernels import edge_operands, fused, fusing

FILE = "fp8_census.csv"
#: an operand's role in its GEMMs -> the tensor kind the tables and diagnoses report
KIND = {"input": "activation", "weight": "weight", "grad_output": "gradient"}
#: fp8_census.csv's columns, in order, and what each holds (docs/fp8.md's table is generated from this)
COLUMN_DOCS = {
    "step": "the census step (the recorder's or the run's step count)",
    "layer": "the linear's module name",
    "gemm": "forward (input x weight), grad_input (grad_output x weight) or grad_weight (grad_output x input)",
    "role": "input, weight or grad_output: the operand",
    "element": "the element format: e4m3, e5m2, e2m1",
    "granularity": "what one scale covers: tensor, row, tile (1x128), block (128x128), mx (1x32), nvfp4 (1x16), "
                   "nvfp4-2d (16x16)",
    "scale_rule": "how the scale is chosen: current, delayed, pow2, one, or MX's rounding (floor, rceil, ...)",
    "numel": "the operand's elements",
    "nonzero": "its non-zero elements",
    "amax": "its largest magnitude this step",
    "history_amax": "delayed scaling's predicted amax the scale came from (the lag); empty for other rules",
    "scale_min": "the smallest scale over its blocks (what multiplies a value into the format); empty: none",
    "scale_max": "the largest scale over its blocks; empty: none",
    "saturated": "elements clipped at the format's largest finite value",
    "flushed": "non-zero elements quantized to zero",
    "subnormal": "elements kept as the format's subnormals (fewer significant bits: precision lost)",
    "nonfinite": "values that came out inf or NaN (an all-zero block without an amax floor)",
    "rel_error": "||q - x|| / ||x|| over the operand",
    "blocks": "its scaling blocks",
    "blocks_clipped": "blocks with at least one clipped element",
    "zero_blocks": "blocks whose amax is 0",
    "worst_block_error": "the largest relative error of one block",
}
COLUMNS = tuple(COLUMN_DOCS)
NUMBERS = COLUMNS[7:]  # what operand_stats computes, in this order
#: scaling block (rows, k) of each granularity; None: the whole dimension (a tensor, a row)
BLOCK = {"tensor": (None, None), "row": (1, None), "tile": (1, 128), "block": (128, 128), "mx": (1, 32),
         "nvfp4": (1, 16), "nvfp4-2d": (16, 16)}


def smallest_normal(element: str) -> float:
    """The element format's smallest normal magnitude (E2M1: 1.0, its one subnormal is 0.5)."""
    dtype = ELEMENTS[element]
    return 1.0 if dtype is None else float(torch.finfo(dtype).smallest_normal)


def _tiled(tk: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """tk (2-D, k last) as (row blocks, rows, k blocks, cols), zero-padded to whole blocks (zeros clip nothing and
    add nothing to an error); a view where tk is contiguous and needs no padding."""
    m, k = tk.shape
    if (-k) % cols or (-m) % rows:
        tk = torch.nn.functional.pad(tk, (0, (-k) % cols, 0, (-m) % rows))
    return tk.reshape(tk.shape[0] // rows, rows, tk.shape[1] // cols, cols)


def _per_block(t: torch.Tensor, k_dim: int, granularity: str, reduce) -> torch.Tensor:
    """reduce(blocks) over each scaling block of t (2-D) as (row blocks, k blocks), reduce taking dimensions (1, 3)
    of the tiled view (_tiled). No copy whether t or its transpose is contiguous (an operand of the weight-gradient
    GEMM, k_dim 0 or go^T, is a transposed view): the transpose's blocks reduced, the (small) result transposed."""
    rows, cols = BLOCK[granularity]
    tk = t if k_dim == 1 else t.t()
    rows, cols = rows or tk.shape[0], cols or tk.shape[1]
    if not tk.is_contiguous() and tk.t().is_contiguous():
        return reduce(_tiled(tk.t(), cols, rows)).t()
    return reduce(_tiled(tk, rows, cols))


def _blocks(x: torch.Tensor, k_dim: int, granularity: str) -> torch.Tensor:
    """x as (blocks, values per block), each row one scaling block (a copy: for tests and the replay's checks)."""
    rows, cols = BLOCK[granularity]
    xk = x if k_dim == 1 else x.t()
    v = _tiled(xk.contiguous(), rows or xk.shape[0], cols or xk.shape[1]).permute(0, 2, 1, 3)
    return v.reshape(v.shape[0] * v.shape[1], v.shape[2] * v.shape[3])


def _block_max(t, k_dim, g):
    return _per_block(t, k_dim, g, lambda b: b.amax(dim=(1, 3)))


def _block_sum(t, k_dim, g):
    return _per_block(t, k_dim, g, lambda b: b.sum(dim=(1, 3))).double()


def _exact_numbers(xf: torch.Tensor, v: torch.Tensor, e: torch.Tensor, clipped: torch.Tensor, k_dim: int,
                   granularity: str, normal: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The census numbers that do not depend on the order of a sum: counts (FP64: nonzero, saturated, flushed,
    subnormal, nonfinite, blocks_clipped, zero_blocks) and extrema (FP32: amax, scale_min, scale_max; inf and 0 where
    no element gives one). `clipped` as uint8 (a bool mask's view). Run fused once hot (_exact_numbers_fused): counts
    and maxima are the same whatever the order in which a kernel visits the elements, so the compiled kernel gives
    these bits. Each count as its path runs it fastest: eager, count_nonzero over bool masks; fused, int32 sums and
    the mask read as numbers (inductor's 64-bit counts and its loops over bool tensors run several times slower;
    an operand has fewer than 2^31 elements, or the fused path counts in int64)."""
    n = xf.numel()
    fast = fusing()
    wide = torch.int32 if n < 2 ** 31 else torch.int64

    def count(mask):
        return mask.sum(dtype=wide) if fast else torch.count_nonzero(mask)
    mask = clipped.float() if fast else clipped.view(torch.bool)
    amax_b = _block_max(xf.abs(), k_dim, granularity)  # 0: an all-zero block (its amax would give an infinite scale)
    clipped_b = _block_max(mask, k_dim, granularity)
    # each element's scale, what multiplies it into the format: |elements / values| (the dequantization divided or
    # multiplied by it, rounded once: exact to an ulp) where the element is non-zero and its value finite and
    # non-zero; every other ratio is 0, inf or NaN, which the comparisons leave out
    ratio = (e / v).abs()
    # subnormal: 0 < |element| < smallest normal (NaN is neither); nonfinite: not finite
    subnormal = count((e.abs() < normal) & (e != 0)) if fast else count(e.abs() < normal) - (n - count(e))
    nonfinite = count(~v.isfinite()) if fast else n - count(v.isfinite())
    nonzero = count(xf != 0) if fast else count(xf)
    counts = torch.stack([nonzero, count(mask), count((v == 0) & (xf != 0)), subnormal, nonfinite,
                          count(clipped_b > 0), count(amax_b == 0)]).double()
    extrema = torch.stack([amax_b.amax(), torch.where(ratio > 0, ratio, math.inf).amin(),
                           torch.where(ratio < math.inf, ratio, 0.0).amax()])
    return counts, extrema


def _probe_numbers(xf, v, e, clipped, k_dim, granularity, normal) -> list[tuple]:
    """Probes of _exact_numbers in its arguments' shape: the formats' edge operands (lab.formats.kernels) as x, a
    quantization of each that flushes, keeps NaN and inf, and scales its elements by powers of two per row."""
    rows, k = xf.shape
    out = []
    for x in edge_operands(rows, -(-k // 16) * 16):
        x = x[:, :k]
        q = torch.where(x.abs() < 2.0 ** -100, 0.0, x.bfloat16().float())
        elements = q * torch.exp2(torch.arange(rows, dtype=torch.float32) % 7 - 3)[:, None]
        out.append((x, q, elements, (x.abs() > 2.0 ** 100).view(torch.uint8), k_dim, granularity, normal))
    return out


_exact_numbers_fused = fused(_probe_numbers)(_exact_numbers)


@torch.no_grad()
def operand_stats(x: torch.Tensor, q: Quantized, fmt: OperandFormat, k_dim: int,
                  history_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The census numbers (NUMBERS) of one quantized operand, an FP64 tensor on x's device (no host sync). `q` must
    come from `quantize(..., stats=True)` (its `elements` and `clipped`). FP32 throughout (a per-block sum's
    rounding is far below what these numbers are read for), counts exact, each block reduced on a view
    (no transposed copies): a census step computes these for every quantized operand of the model. The counts and
    extrema run as one fused kernel once hot (_exact_numbers); the error sums stay eager (their bits depend on the
    order of the sum)."""
    if q.elements is None or q.clipped is None:
        raise ValueError("operand_stats needs a quantization with stats=True (elements and clipped)")
    f64, g, dev = torch.float64, fmt.granularity, x.device
    xf, v = x.detach().to(torch.float32), q.values
    n = xf.numel()
    nan = torch.tensor(math.nan, dtype=f64, device=dev)
    counts, extrema = _exact_numbers_fused(xf, v, q.elements, q.clipped.view(torch.uint8), k_dim, g,
                                           smallest_normal(fmt.element))
    nonzero, saturated, flushed, subnormal, nonfinite, blocks_clipped, zero_blocks = counts
    amax, scale_min, scale_max = extrema.double()
    # the error laid out as x is, whatever the values' layout (a reused transposed quantization): each block's sum
    # then runs in x's order, the same bits as for the same operand quantized in place
    err_b = _block_sum(torch.sub(v, xf, out=torch.empty_like(xf)).square_(), k_dim, g)
    ref_b = _block_sum(xf.square(), k_dim, g)
    worst = torch.where(ref_b > 0, err_b / ref_b, torch.zeros_like(ref_b)).max().sqrt()
    # no element to read a scale from (an all-zero or all-flushed operand): NaN, not an infinity or 0
    scale_min = torch.where(torch.isfinite(scale_min), scale_min, nan)
    scale_max = torch.where(scale_max > 0, scale_max, nan)
    blocks = _block_count(tuple(x.shape), k_dim, g)
    return torch.stack([
        torch.tensor(float(n), dtype=f64, device=dev), nonzero, amax,
        nan if history_amax is None else history_amax.detach().double().reshape(()), scale_min, scale_max,
        saturated, flushed, subnormal, nonfinite, (err_b.sum() / ref_b.sum().clamp_min(1e-300)).sqrt(),
        torch.tensor(float(blocks), dtype=f64, device=dev), blocks_clipped, zero_blocks, worst])


def _block_count(shape: tuple, k_dim: int, granularity: str) -> int:
    """How many scaling blocks an operand of `shape` has (its k along k_dim; partial blocks padded, as _tiled)."""
    rows, cols = BLOCK[granularity]
    m, k = shape if k_dim == 1 else shape[::-1]
    return -(-m // (rows or m)) * -(-k // (cols or k))


_TEXT = ("layer", "gemm", "role", "element", "granularity", "scale_rule")
_COUNTS = ("step", "numel", "nonzero", "saturated", "flushed", "subnormal", "nonfinite", "blocks", "blocks_clipped",
           "zero_blocks")


def read_rows(run_dir, required=COLUMNS) -> list[dict] | None:
    """A run's fp8_census.csv as rows (names as text, a layer "0" included; counts as ints; the rest floats, NaN where
    empty); None when the run has none. Read through lab.core.runfiles, like every run file: RunFileError naming the
    file and line when it is damaged or lacks a ``required`` column; a live run's incomplete last line is left out
    (runfiles.is_live)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    _, raw = runfiles.read_csv(path, required, live=runfiles.is_live(path))
    return [_row(path, r) for r in raw]


def _row(path: Path, r: dict) -> dict:
    out = {}
    for k in (c for c in COLUMNS if c in r):
        if k in _TEXT:
            out[k] = r[k]
        elif k in _COUNTS:
            out[k] = runfiles.number(path, r, k, int)
        else:  # empty: not measured (no history yet, no element to read a scale from)
            out[k] = runfiles.number(path, r, k) if r[k].strip() else math.nan
    return out


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
        # an MX operand's scale rule is its E8M0 rounding (lab diagnose reads floor's clipped blocks)
        self.pending.append(({"step": step, "layer": layer, "gemm": gemm, "role": role, "element": fmt.element,
                              "granularity": fmt.granularity, "scale_rule": fmt.scale_rounding or fmt.scale}, numbers))

    def take(self) -> list[dict]:
        if not self.pending:
            return []
        values = torch.stack([n.cpu() for _, n in self.pending]).tolist()
        out = [{**key, **dict(zip(NUMBERS, v))} for (key, _), v in zip(self.pending, values)]
        self.pending.clear()
        return out

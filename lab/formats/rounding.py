"""Stochastic rounding onto an element format's grid (E4M3, E5M2, E2M1).

A value between two neighbouring representable values lo < |x| < hi becomes hi with probability
(|x| - lo) / (hi - lo) and lo otherwise, so the rounding is unbiased: E[round(x)] = x. Values on the grid stay as they
are (probability 0 of moving), magnitudes at or above the format's maximum saturate to it (the NVFP4 recipe clips
before it rounds), NaN stays NaN. Computed in FP32 from FP32/BF16 inputs, where every step is exact: the binade from
the exponent bits, the quantum a power of two, lo = mag truncated to it and (mag - lo) / quantum (within one quantum:
exact); FP64 for FP64 inputs. Returned in x's dtype: grid values of these formats are exact in FP32 and BF16 (at most
3 mantissa bits). The draw u is uniform on [0, 1) in the compute dtype (FP32: steps of 2^-24, the probabilities'
resolution).
"""
from __future__ import annotations

import sys

import torch

from lab.formats.elements import max_of

#: mantissa bits and smallest normal exponent of each element format (subnormals below 2**emin share its quantum)
_GRID = {"e4m3": (3, -6), "e5m2": (2, -14), "e2m1": (1, 0)}


#: per float dtype: the integer of its width, its mantissa bits, its exponent bias
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def e2m1_quantum(x: torch.Tensor) -> torch.Tensor:
    """E2M1's grid spacing at each value within +-6: 0.5 below 2 (subnormals and 0 share the first binade's), 1 below
    4, 2 above (and for NaN). By comparisons rather than from the exponent bits: plain elementwise steps, no view of
    an intermediate's bits, for the fused NVFP4 kernel (lab/formats/kernels.py) to compile like any other."""
    a = x.abs()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def _quantum(mag: torch.Tensor, element: str) -> torch.Tensor:
    """The element's quantum (grid spacing) at each FP32 or FP64 magnitude's binade, a power of two: read from mag's
    exponent bits (frexp and ldexp are ~10x slower on the CPU); subnormals and 0 (below emin either way) take the
    smallest normal binade's."""
    if element == "e2m1":  # within +-6: by comparisons (e2m1_quantum; the fused NVFP4 kernel uses it)
        return e2m1_quantum(mag)
    mbits, emin = _GRID[element]
    int_dtype, mant, bias = _FLOAT_BITS[mag.dtype]
    biased = (mag.view(int_dtype) >> mant).clamp_(min=emin + bias)
    return biased.sub_(mbits).bitwise_left_shift_(mant).view(mag.dtype)


def neighbours(mag: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable magnitudes lo <= mag < hi around each (finite, non-negative, below max) FP32 or FP64
    magnitude: lo is mag truncated to the element's quantum at mag's binade, hi = lo + that quantum."""
    quantum = _quantum(mag, element)
    lo = torch.floor(mag / quantum) * quantum  # division by a power of two: exact
    return lo, lo + quantum


def stochastic_round(x: torch.Tensor, element: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """x rounded stochastically onto `element`'s grid, saturating at its maximum; one uniform draw per element from
    `generator` (pass a seeded one for reproducible draws; None: torch's default generator)."""
    if element not in _GRID:
        raise ValueError(f"stochastic_round: element {element!r} is not one of {sorted(_GRID)}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return round_with_draws(x, element, uniform_draws(x, generator, dtype))


def uniform_draws(x: torch.Tensor, generator: torch.Generator | None, dtype=torch.float32) -> torch.Tensor:
    """stochastic_round's draws for x: one uniform on [0, 1) per element, in x's (row-major) order."""
    return torch.rand(x.shape, generator=generator, dtype=dtype, device=x.device)


#: the draws' resolution: torch.rand's float32 draw is a 32-bit generator output's low 24 bits times 2^-24
DRAW_BITS = 24


def uniform_words(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """uniform_draws(x, generator)'s generator outputs, two to an int64 (x.numel() / 2 of them; x.numel() even):
    torch's random_() of an int64 takes two 32-bit outputs, the first in its high word, and costs ~35% less a draw
    than random_ of one int32 per element (each a virtual call and a modulo). draws_from_words unpacks them."""
    if x.numel() % 2:
        raise ValueError(f"uniform_words draws two to a word: x needs an even number of elements, got {x.numel()}")
    return torch.empty(x.numel() // 2, dtype=torch.int64, device=x.device).random_(generator=generator)


def draws_from_words(words: torch.Tensor, shape) -> torch.Tensor:
    """uniform_words' outputs in the generator's order as integers k (int32, in `shape`), each draw k * 2^-DRAW_BITS:
    the numbers torch.rand draws from the same generator state (the low 24 bits of one output per element;
    tests/test_formats_blocks.py), which it leaves where torch.rand does. Elementwise steps and a view, for a fused
    kernel to do in its loop (lab/formats/nvfp4.py)."""
    halves = words.view(torch.int32).view(-1, 2)  # each word's two 32-bit halves in memory order
    if sys.byteorder == "little":  # the high word, the first output, comes second in memory
        halves = halves.flip(-1)
    return halves.bitwise_and(2 ** DRAW_BITS - 1).view(shape)


def round_with_draws(x: torch.Tensor, element: str, u: torch.Tensor) -> torch.Tensor:
    """x rounded onto `element`'s grid stochastically by the draws u (x's shape, uniform_draws): up where u is below
    the distance to the grid point below in quanta. Every step is exact (see the module's docstring)."""
    top = max_of(element)
    xc = x.detach().to(u.dtype)
    mag = xc.abs().clamp_(max=top)  # saturate first (max itself is on the grid: it stays); NaN stays NaN
    quantum = _quantum(mag, element)
    # in units of the quantum (exact: a power of two) mag is steps + p_up, lo = steps * quantum, hi one step more:
    # (mag - lo) / (hi - lo) = p_up exactly
    units = mag.div_(quantum)
    steps = units.floor()
    p_up = units.sub_(steps)
    # u < p_up is never true for p_up == 0: a value on the grid (max included) stays exact
    rounded = steps.add_(u < p_up).mul_(quantum)
    return torch.copysign(rounded, xc).to(x.dtype)

"""Stochastic rounding onto an element format's grid (E4M3, E5M2, E2M1).

A value between two neighbouring representable values lo < |x| < hi becomes hi with probability
(|x| - lo) / (hi - lo) and lo otherwise, so the rounding is unbiased: E[round(x)] = x. Values on the grid stay as they
are (probability 0 of moving), magnitudes at or above the format's maximum saturate to it (the NVFP4 recipe clips
before it rounds), NaN stays NaN. Computed in FP64 (every grid value and every FP32 input is exact there), returned
in x's dtype: grid values of these formats are exact in FP32 and BF16 (their mantissas have at most 3 bits).
"""
from __future__ import annotations

import torch

from lab.formats.elements import max_of

#: mantissa bits and smallest normal exponent of each element format (subnormals below 2**emin share its quantum)
_GRID = {"e4m3": (3, -6), "e5m2": (2, -14), "e2m1": (1, 0)}


def neighbours(mag: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable magnitudes lo <= mag < hi around each (finite, non-negative, below max) FP64 magnitude:
    lo is mag truncated to the element's quantum at mag's binade, hi = lo + that quantum."""
    mbits, emin = _GRID[element]
    # the binade's exponent; subnormals (and 0, whose log2 is -inf) use the smallest normal binade's quantum
    exp = torch.floor(torch.log2(mag)).clamp(min=emin)
    quantum = torch.exp2(exp - mbits)
    lo = torch.floor(mag / quantum) * quantum  # division by a power of two: exact in FP64
    return lo, lo + quantum


def stochastic_round(x: torch.Tensor, element: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """x rounded stochastically onto `element`'s grid, saturating at its maximum; one uniform draw per element from
    `generator` (pass a seeded one for reproducible draws; None: torch's default generator)."""
    if element not in _GRID:
        raise ValueError(f"stochastic_round: element {element!r} is not one of {sorted(_GRID)}")
    top = max_of(element)
    x64 = x.detach().to(torch.float64)
    mag = x64.abs().clamp(max=top)  # saturate first: the draw then picks between grid values only
    lo, hi = neighbours(torch.where(mag < top, mag, torch.zeros_like(mag)), element)
    p_up = (mag - lo) / (hi - lo)
    u = torch.rand(x64.shape, generator=generator, dtype=torch.float64, device=x64.device)
    # u < p_up is never true for p_up == 0: a value on the grid stays exact
    rounded = torch.where(u < p_up, hi, lo)
    rounded = torch.where(mag >= top, mag, rounded)
    out = torch.copysign(rounded, x64)
    out = torch.where(torch.isnan(x64), x64, out)
    return out.to(x.dtype)

"""FP16 numerics of gradients: what an FP16 cast makes of them, per layer, during training.

``census(values, scale)`` classifies every element of ``scale * values`` by what rounding it to FP16 gives;
``log2_histogram(values)`` counts magnitudes in binades; ``Tally`` batches both over many tensors and keys.
``lab.numerics.monitor.NumericsMonitor`` uses them on a model's gradients during training (columns in docs/census.md).

Exact semantics of the census
-----------------------------
Each element ``x`` (FP16, BF16, FP32 or FP64) is classified by ``round16(scale * x)``, where ``scale * x``
is the *exact* real product (never a product rounded in some working dtype) and ``round16`` is IEEE
binary16 round-to-nearest-even (what an FP32 -> FP16 cast does):

* ``zero``: x == 0 (also -0.0);
* ``underflow``: x != 0 but round16 gives 0: ``|scale*x| <= UNDERFLOW_BOUND`` (2^-25; the tie goes to 0);
* ``subnormal``: a non-zero FP16 subnormal: ``UNDERFLOW_BOUND < |scale*x| < NORMAL_BOUND`` (2^-14 - 2^-25);
* ``normal``: ``NORMAL_BOUND <= |scale*x| < OVERFLOW_BOUND`` (65520; 65504 is the largest finite FP16);
* ``overflow``: ``|scale*x| >= OVERFLOW_BOUND`` (rounds to +-inf), or x is inf/-inf/nan.

The bounds are derived from ``torch.finfo(torch.float16)`` (smallest subnormal = smallest_normal * eps,
half of it; smallest_normal minus half a subnormal step; max plus half an ulp of the top binade). For a
power-of-two scale and FP32 values this is exactly ``(scale * x).to(torch.float16)`` (the FP32 product is
exact unless it overflows FP32, which is an FP16 overflow too). Note: torch's FP64 -> FP16 cast rounds
twice (through FP32), so on FP64 values it can differ from this single correct rounding near a bound.

How it is computed, without a host synchronisation per tensor
-------------------------------------------------------------
For each input dtype and scale the bounds are turned, once, on the host and exactly (rational arithmetic),
into *thresholds in that dtype*: the least value t of the dtype with ``scale * t`` past the bound, so that
``|x| >= t`` holds exactly when ``scale * x`` is past it. All thresholds a tally needs (several scales and
the histogram's binades) are counted in one pass over the tensor's bit patterns (``_Plan``): integer ops,
one bin count (``count_method``: ``bincount`` on CPU; ``histc`` on GPUs, whose ``bincount`` synchronises),
a prefix sum read at the thresholds, added to a small device accumulator. ``Tally.result()`` copies every
accumulator to the host with one ``tolist()`` per device. NaN (sign cleared) sorts above +inf: it counts as
non-finite.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Iterable

import torch

from lab.core.fp16 import NORMAL_BOUND, OVERFLOW_BOUND, SMALLEST_SUBNORMAL, UNDERFLOW_BOUND

__all__ = ["Census", "Log2Histogram", "census", "log2_histogram", "Tally", "TallyResult",
           "CENSUS_FIELDS", "CENSUS_COLUMNS", "HIST_COLUMNS", "COUNTERFACTUAL_SCALES",
           "UNDERFLOW_BOUND", "NORMAL_BOUND", "OVERFLOW_BOUND", "SMALLEST_SUBNORMAL", "HIST_RANGE"]

_F16 = torch.finfo(torch.float16)

CENSUS_FIELDS = ("total", "zero", "underflow", "subnormal", "normal", "overflow")
#: census.csv; layer "__total__" sums a step's rows of one (source, at_scale); grads: the precision of the
#: values counted (the run's own, or "fp32" for an FP16 run's FP32 replay of a census step: lab/numerics/monitor.py)
CENSUS_COLUMNS = ["step", "scale", "source", "layer", "at_scale", *CENSUS_FIELDS, "grads"]
#: grad_hist.csv; log2_bin is an integer k (lo <= k < hi, counting lo <= log2|x| < k+1, the end bins
#: clamped), or "zero" or "nonfinite"
HIST_COLUMNS = ["step", "source", "at_scale", "log2_bin", "count", "grads"]
#: the log2 histogram's bins (lo, hi): lo <= k < hi, the end bins taking what lies beyond them
HIST_RANGE = (-40, 20)
#: FP32 runs: the scales at which the census asks "what would FP16 make of these gradients?"
COUNTERFACTUAL_SCALES = (1.0, 128.0, 1024.0, 65536.0)


def replay_rows(rows: list[dict]) -> list[dict]:
    """An FP16 run's FP32-replay census rows: grads "fp32" at one scale per step and source (the counterfactual
    steps after an FP32 fallback hold several scales). Rows without `grads` (older runs) are the run's own."""
    scales: dict[tuple, set] = {}
    fp32 = [r for r in rows if r.get("grads") == "fp32"]
    for r in fp32:
        scales.setdefault((r["step"], r["source"]), set()).add(r["at_scale"])
    return [r for r in fp32 if len(scales[(r["step"], r["source"])]) == 1]
TOTAL = "__total__"
_CHUNK = 1 << 24  # elements per counting pass: bounds temporaries, keeps float32 histc counts exact


@dataclass(frozen=True)
class Census:
    """Counts of elements by what an FP16 cast makes of them; the five classes add up to ``total``."""

    total: int = 0
    zero: int = 0
    underflow: int = 0
    subnormal: int = 0
    normal: int = 0
    overflow: int = 0

    def __add__(self, other: "Census") -> "Census":
        return Census(*(getattr(self, f) + getattr(other, f) for f in CENSUS_FIELDS))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Log2Histogram:
    """``counts[i]``: non-zero finite x with lo + i <= log2|x| < lo + i + 1 (the end bins take the rest)."""

    lo: int
    hi: int
    counts: tuple[int, ...]
    zero: int = 0
    nonfinite: int = 0

    def __add__(self, other: "Log2Histogram") -> "Log2Histogram":
        if (self.lo, self.hi) != (other.lo, other.hi):
            raise ValueError("histograms over different bins cannot be added")
        return Log2Histogram(self.lo, self.hi, tuple(a + b for a, b in zip(self.counts, other.counts)),
                             self.zero + other.zero, self.nonfinite + other.nonfinite)

    def as_dict(self) -> dict[Any, int]:
        """{k: count for each bin} plus "zero" and "nonfinite"."""
        return {**{self.lo + i: c for i, c in enumerate(self.counts)}, "zero": self.zero, "nonfinite": self.nonfinite}

    @property
    def total(self) -> int:
        return sum(self.counts) + self.zero + self.nonfinite


# --- thresholds: exact, per dtype ----------------------------------------------------------------------
def _least(pred, guess: float, dtype: torch.dtype) -> float:
    """The least non-negative value t of ``dtype`` (+inf included) with pred(t).

    pred must be monotone in t and true at +inf; ``guess`` is a close approximation (one or two ulps).
    """
    t = torch.tensor(guess, dtype=torch.float64).to(dtype)
    zero, inf = torch.zeros((), dtype=dtype), torch.full((), math.inf, dtype=dtype)
    while float(t) > 0 and pred(float(torch.nextafter(t, zero))):
        t = torch.nextafter(t, zero)
    while not pred(float(t)):
        t = torch.nextafter(t, inf)
    return float(t)


def _past(scale: float, bound: float, strict: bool):
    """pred(x): is the exact product scale * x above (strict) or at/above the bound?"""
    s, b = Fraction(scale), Fraction(bound)

    def pred(x: float) -> bool:
        if math.isinf(x):
            return True
        v = s * Fraction(x)
        return v > b if strict else v >= b
    return pred


def _check_scale(scale) -> float:
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    return scale


class _Plan:
    """Exact threshold counts for one dtype, a set of census scales and a histogram.

    Every named threshold t is a value of the dtype (see ``_least``), so ``|x| >= t`` compares bit patterns:
    with the sign bit cleared, a float's bits read as an integer grow with its magnitude (inf above every
    finite value, NaN above inf). For 16-bit dtypes those 15 bits index a bin count (2^15 bins); for wider
    ones the exponent does (FP32: 2^8 bins), and each threshold with mantissa bits (``lows``: 3 distinct
    patterns for any set of power-of-two scales, none for the binades) splits its exponent's bin with one
    integer comparison per element. A prefix sum of the bins, read at the thresholds' positions, gives each
    threshold's count of elements below it.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, scales: tuple[float, ...],
                 hist: tuple[int, int] | None, hist_scale: float):
        named: dict[Any, float] = {"nonzero": _least(lambda x: x > 0, 0.0, dtype), "nonfinite": math.inf}
        for s in scales:
            named[("uf", s)] = _least(_past(s, UNDERFLOW_BOUND, True), UNDERFLOW_BOUND / s, dtype)
            named[("nm", s)] = _least(_past(s, NORMAL_BOUND, False), NORMAL_BOUND / s, dtype)
            named[("of", s)] = _least(_past(s, OVERFLOW_BOUND, False), OVERFLOW_BOUND / s, dtype)
        if hist is not None:
            for k in range(hist[0] + 1, hist[1]):
                named[("h", k)] = _least(_past(hist_scale, 2.0 ** k, False), 2.0 ** k / hist_scale, dtype)
        bits = torch.finfo(dtype).bits
        self.int_dtype = _INT_OF_WIDTH_BY_DTYPE[dtype]
        # 16-bit dtypes: the whole magnitude is the key (2^15 bins); wider ones: the exponent is (FP32: 2^8
        # bins), and the few thresholds with mantissa bits split their exponent's bin by comparisons
        self.shift = 0 if bits == 16 else round(-math.log2(torch.finfo(dtype).eps))
        self.hi_mask = (1 << (bits - 1 - self.shift)) - 1
        self.lo_mask = (1 << self.shift) - 1
        keys = {name: int(torch.tensor(v, dtype=dtype).view(self.int_dtype).item()) for name, v in named.items()}
        self.lows = sorted({k & self.lo_mask for k in keys.values()} - {0})
        self.stride_bits = len(self.lows).bit_length()  # bins per exponent: a power of two > len(lows)
        self.stride = 1 << self.stride_bits
        self.nbins = (self.hi_mask + 1) * self.stride

        def position(k: int) -> int:  # index of the first bin whose elements are all >= the threshold
            lo = k & self.lo_mask
            return (k >> self.shift) * self.stride + sum(1 for low in self.lows if low <= lo)
        uniq = sorted({position(k) for k in keys.values()})
        index = {p: i for i, p in enumerate(uniq)}
        self.slot = {name: index[position(k)] for name, k in keys.items()}
        self.positions = torch.tensor(uniq, dtype=torch.int64, device=device)
        self._last_below = self.positions - 1  # every threshold is > 0, so positions >= 1
        self.scales, self.hist = scales, hist

    def _keys(self, chunk: torch.Tensor) -> torch.Tensor:
        b = chunk.view(self.int_dtype)
        if self.shift == 0:
            return b & self.hi_mask
        # exponent * stride in two passes, then + (mantissa >= low) for each low
        key = (b >> (self.shift - self.stride_bits)).bitwise_and_(self.hi_mask << self.stride_bits)
        if self.lows:
            lo = b & self.lo_mask
            ge = torch.empty_like(lo)
            for low in self.lows:
                key.add_(torch.ge(lo, low, out=ge))
        return key

    def bins(self, x: torch.Tensor, method: str | None = None) -> torch.Tensor | None:
        """Int64 bin counts of x's keys on x's device (None for an empty tensor).

        ``method``: how to count (default: ``count_method(x.device)``); tests pass each one on CPU.
        """
        method = method or count_method(x.device)
        flat = x.detach().reshape(-1)
        bins = None
        for start in range(0, flat.numel(), _CHUNK):
            c = _count(self._keys(flat[start:start + _CHUNK]), self.nbins, method)
            bins = c if bins is None else bins.add_(c)
        return bins

    def below(self, bins: torch.Tensor) -> torch.Tensor:
        """Counts of elements below each threshold position, from bin counts (small, on the device)."""
        return bins.cumsum(0)[self._last_below]

    def _ge(self, below: list[int], total: int, name) -> int:  # elements with |x| >= that threshold
        return total - below[self.slot[name]]

    def census(self, below: list[int], total: int, scale: float) -> Census:
        nonzero = self._ge(below, total, "nonzero")
        uf, nm, of = (self._ge(below, total, (c, scale)) for c in ("uf", "nm", "of"))
        return Census(total=total, zero=total - nonzero, underflow=nonzero - uf, subnormal=uf - nm,
                      normal=nm - of, overflow=of)

    def histogram(self, below: list[int], total: int) -> Log2Histogram:
        lo, hi = self.hist
        nonzero, nonfinite = self._ge(below, total, "nonzero"), self._ge(below, total, "nonfinite")
        edges = [nonzero] + [self._ge(below, total, ("h", k)) for k in range(lo + 1, hi)] + [nonfinite]
        return Log2Histogram(lo, hi, tuple(a - b for a, b in zip(edges, edges[1:])), total - nonzero, nonfinite)


def count_method(device: torch.device) -> str:
    """How bins are counted on a device: ``bincount`` on CPU; on GPUs ``histc`` (CUDA's bincount reads the
    largest key back to the host: a sync per tensor), or ``index_put`` when deterministic algorithms are on
    (histc's CUDA kernel has no deterministic variant and would raise)."""
    if device.type == "cpu":
        return "bincount"
    return "index_put" if torch.are_deterministic_algorithms_enabled() else "histc"


def _count(key: torch.Tensor, nbins: int, method: str) -> torch.Tensor:
    """Int64 counts of each key value 0..nbins-1 (keys are integers in that range)."""
    if method == "bincount":
        return torch.bincount(key, minlength=nbins)
    if method == "index_put":
        return torch.zeros(nbins, dtype=torch.int64, device=key.device).index_put_(
            (key.long(),), torch.ones((), dtype=torch.int64, device=key.device), accumulate=True)
    if method == "histc":
        # exact in float32: keys < 2^24 are exact floats, nbins is a power of two (bin = key * nbins / nbins
        # has no rounding in CUDA's kernel) and a chunk has at most 2^24 elements, so counts stay exact
        return torch.histc(key.float(), bins=nbins, min=0, max=nbins).long()
    raise ValueError(f"unknown count method {method!r}")


_INT_OF_WIDTH_BY_DTYPE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
                          torch.float64: torch.int64}


@functools.lru_cache(maxsize=256)
def _plan(dtype: torch.dtype, device: torch.device, scales: tuple[float, ...], hist: tuple[int, int] | None,
          hist_scale: float) -> _Plan:
    return _Plan(dtype, device, scales, hist, hist_scale)


def _as_list(values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    out = list(values)
    for v in out:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"values must be a tensor or a list of tensors, got {type(v).__name__}")
    return out


class TallyResult:
    """The counts of one key: ``census(scale)`` and ``hist()``; results add up (``a + b``)."""

    def __init__(self, parts: dict[_Plan, tuple[list[int], int]]):
        self.parts = parts  # plan (one per dtype/device) -> (counts below each threshold, element count)

    def __add__(self, other: "TallyResult") -> "TallyResult":
        parts = dict(self.parts)
        for plan, (below, total) in other.parts.items():
            if plan in parts:
                b0, t0 = parts[plan]
                parts[plan] = ([a + b for a, b in zip(b0, below)], t0 + total)
            else:
                parts[plan] = (below, total)
        return TallyResult(parts)

    def census(self, scale: float = 1.0) -> Census:
        out = Census()
        for plan, (below, total) in self.parts.items():
            out = out + plan.census(below, total, scale)
        return out

    def hist(self) -> Log2Histogram | None:
        out = None
        for plan, (below, total) in self.parts.items():
            if plan.hist is not None:
                h = plan.histogram(below, total)
                out = h if out is None else out + h
        return out


class Tally:
    """Counts tensors under keys on their device; ``result()`` resolves every key with one host sync per device.

    ``scales``: the census scales; ``hist``: (lo, hi) for a log2 histogram (of ``hist_scale * x``), or None.
    """

    def __init__(self, scales: Iterable[float] = (1.0,), hist: tuple[int, int] | None = None,
                 hist_scale: float = 1.0):
        self.scales = tuple(_check_scale(s) for s in scales)
        if hist is not None:
            lo, hi = int(hist[0]), int(hist[1])
            if hi <= lo:
                raise ValueError(f"log2 histogram needs lo < hi, got lo={lo}, hi={hi}")
            hist = (lo, hi)
        self.hist, self.hist_scale = hist, _check_scale(hist_scale)
        self._acc: dict[tuple, torch.Tensor] = {}   # (key, dtype, device) -> counts below each threshold
        self._numel: dict[tuple, int] = {}

    def _plan(self, dtype: torch.dtype, device: torch.device) -> _Plan:
        return _plan(dtype, device, self.scales, self.hist, self.hist_scale)

    def add(self, key, values) -> None:
        """Count a tensor (or tensors) under ``key``; asynchronous, nothing leaves the device."""
        groups: dict[tuple, torch.Tensor] = {}
        for x in _as_list(values):
            if x.dtype not in _INT_OF_WIDTH_BY_DTYPE:
                raise TypeError(f"census counts float16, bfloat16, float32 and float64 tensors, not {x.dtype}")
            slot = (key, x.dtype, x.device)
            self._numel[slot] = self._numel.get(slot, 0) + x.numel()
            b = self._plan(x.dtype, x.device).bins(x)
            if b is not None:
                groups[slot] = b if slot not in groups else groups[slot].add_(b)
        for slot, b in groups.items():
            below = self._plan(slot[1], slot[2]).below(b)
            prev = self._acc.get(slot)
            self._acc[slot] = below if prev is None else prev.add_(below)

    def result(self) -> dict[Any, TallyResult]:
        """Every key's counts; one host sync per device (none for an empty tally)."""
        out: dict[Any, TallyResult] = {}
        by_device: dict[torch.device, list[tuple]] = {}
        for slot in self._numel:
            by_device.setdefault(slot[2], []).append(slot)
        for device, slots in by_device.items():
            counted = [s for s in slots if s in self._acc]
            flat = torch.cat([self._acc[s] for s in counted]).tolist() if counted else []  # the one sync
            i = 0
            for slot in slots:
                key, dtype, _ = slot
                plan = self._plan(dtype, device)
                n = len(plan.positions)
                if slot in self._acc:
                    below, i = flat[i:i + n], i + n
                else:
                    below = [0] * n
                r = TallyResult({plan: (below, self._numel[slot])})
                out[key] = out[key] + r if key in out else r
        return out


def census(values, scale: float = 1.0) -> Census:
    """Classify every element of ``scale * values`` by what an FP16 cast gives (see the module docstring).

    ``values``: a tensor or a list of tensors (any float dtypes and devices): one result over all of them,
    counted on the device with a single host synchronisation.
    """
    tally = Tally(scales=(scale,))
    tally.add(None, values)
    res = tally.result()
    return res[None].census(tally.scales[0]) if res else Census()


def log2_histogram(values, lo: int = HIST_RANGE[0], hi: int = HIST_RANGE[1], scale: float = 1.0) -> Log2Histogram:
    """Counts of floor(log2|scale * x|) for non-zero finite x in bins lo..hi-1 (ends clamped), plus zero and
    non-finite counts; batched like ``census``. Bins are exact: k counts 2^k <= |scale*x| < 2^(k+1)."""
    tally = Tally(scales=(), hist=(lo, hi), hist_scale=scale)
    tally.add(None, values)
    res = tally.result()
    return res[None].hist() if res else Log2Histogram(lo, hi, (0,) * (tally.hist[1] - tally.hist[0]))

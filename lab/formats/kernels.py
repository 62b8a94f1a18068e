"""Fused quantizer kernels: a quantizer's elementwise steps (or the accumulator model's) compiled into a few loops
by inductor (its C++ backend), used only where they give the eager steps' bits.

Why: a block-scaled quantizer in eager torch is ~25 small calls, each a pass over the operand (torchao's `to_mx`,
the lab's NVFP4): on the CPU the passes, not the arithmetic, are its cost, and fused they take about half the time.
A function is traced to aten ops (make_fx) and compiled by inductor (compile_fx), not through torch.compile: no
frame evaluation and guards on each call (~15 us, a tenth of a small kernel), and torchao's code runs as in eager
(under dynamo `to_mx` drops its clamp before the FP8 cast, written for Triton's saturating casts: the CPU's E5M2
cast gives inf). Compiled, a kernel is not always its eager self (torch 2.14.1, torchao 0.18.0: under EVEN rounding
`to_mx`'s elements come out different; not isolated, it writes in place through an int32 view of the amax). So each
kernel proves itself where it runs: the first call with a new combination of constants (element, rounding, ...) and
shapes quantizes probes of that shape (the formats' edge cases: values that clip, NaN, inf, zero and subnormal
blocks, the scale roundings' boundaries) both ways, and a combination whose bits differ runs eager for the rest of
the process, with a warning. (Compiled with dynamic shapes, the NVFP4 kernel misread its block scales at some
positions: static shapes, one graph per shape, each one probed.) tests/test_formats_kernels.py checks the admitted
kernels against the eager steps on larger operands, and that a kernel the probe catches runs eager.

A kernel is compiled once it is hot: from its COMPILE_AFTER-th call (compiling costs more than a short run saves),
or sooner where it says so (`fused(after=...)`: the Hopper accumulator model, lab/formats/accumulate.py);
`LAB_COMPILED_QUANTIZERS=1` compiles from the first call (the benchmarks' steady state), `=0` (or
`use_compiled(False)`) runs everything eager: the test suite does (each compiled graph costs seconds the first
time). Where the compiler cannot run (no C++ compiler), the first call warns and the process goes on eager. CUDA
tensors run eager.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

ENV = "LAB_COMPILED_QUANTIZERS"
_warned: set = set()
#: calls of one kernel (constants and shape) before it is compiled: compiling one costs ~0.4 s (warm cache) and saves
#: ~0.15 ms a call on the LM's operands, so a kernel pays for itself after ~2,700 calls; the study's 300-step runs
#: would lose time to it (28 kernels an NVFP4 run: ~11 s), a run of thousands of steps gains
COMPILE_AFTER = 1000
_state = {"enabled": os.environ.get(ENV, "auto") != "0", "failed": None,
          "after": 0 if os.environ.get(ENV) == "1" else COMPILE_AFTER, "admitted": 0, "fusing": False}


def use_compiled(enabled: bool, after: int = 0) -> None:
    """Turn the compiled kernels on or off for this process, each compiled from its `after`-th call on (the
    default: $LAB_COMPILED_QUANTIZERS 0: off, 1: from the first call, unset: from the COMPILE_AFTER-th)."""
    _state["enabled"], _state["after"] = bool(enabled), int(after)


def compiled_in_use() -> bool:
    """Whether the quantizers may run compiled (on, and the compiler has not failed): recorded in a run's
    provenance."""
    return _state["enabled"] and _state["failed"] is None


def provenance() -> dict:
    """What a run records: whether the kernels could run compiled and from which call, how many (constants and
    shapes) did, why none if the compiler failed, and which kernels the probe refused and so ran eager."""
    return {"compiled": compiled_in_use(), "compile_after_calls": _state["after"],
            "kernels_compiled": _state["admitted"], "compiler_failure": _state["failed"],
            "refused": sorted(f"{fn.__qualname__}{constants[:-1]}" for fn, constants in _warned)}


def same_bits(a, b) -> bool:
    """Whether two results (tensors, or tuples of them) are equal bit for bit (-0 against +0 included), a NaN
    standing for any NaN (its sign and payload mean nothing to training, and eager kernels' differ among CPUs)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers, every NaN of a floating dtype made the same one."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.contiguous().view(ints)
    if t.is_floating_point() and t.element_size() > 1:
        bits = torch.where(t.isnan(), torch.zeros_like(bits) - 1, bits)
    return bits


def fused(probe, options: dict | None = None, after: int | None = None):
    """Decorator: fn(operand, ...) (tensors and constants) compiled for CPU tensors, one graph per combination of
    its constants and its tensors' shapes, each admitted once every argument tuple of `probe(*args)` (fn's edge
    cases in args' shapes, with args' constants) gives the same bits both ways. `options`: inductor's config,
    patched for this kernel; `after`: a kernel that pays for its compilation sooner than COMPILE_AFTER calls is
    compiled from its `after`-th call (or the process's setting, whichever is sooner)."""
    def decorate(fn):
        admitted: dict[tuple, bool] = {}
        compiled: dict[tuple, object] = {}
        calls: dict[tuple, int] = {}

        @functools.wraps(fn)
        def run(*args):
            if not compiled_in_use() or args[0].device.type != "cpu":
                return fn(*args)
            # what a static graph is specialised on: each tensor's shape, strides and dtype, the constants' values
            key = tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                        for a in args) + (torch.is_grad_enabled(),)
            if key not in admitted:
                calls[key] = calls.get(key, 0) + 1
                if calls[key] <= (_state["after"] if after is None else min(after, _state["after"])):  # not hot yet
                    return fn(*args)
                compiled[key] = _compile_on_first_call(fn, options)
                probes = [tuple(_laid_out_as(p, a) for p, a in zip(probe_args, args)) for probe_args in probe(*args)]
                admitted[key] = _admit(fn, compiled[key], probes, key)
                _state["admitted"] += admitted[key]
            return compiled[key](*args) if admitted[key] and compiled_in_use() else fn(*args)
        run.eager = fn
        run.admitted = admitted
        return run
    return decorate


def fusing() -> bool:
    """Whether a kernel's function is being traced to be fused (its cheaper formulations of the same values: an FP8
    decode by conversion rather than table lookup, one reduction rather than slices), not run eager."""
    return _state["fusing"]


def _compile_on_first_call(fn, options: dict | None = None):
    """fn traced at its first call's shapes and constants (make_fx, a graph of aten ops) and compiled by inductor
    (compile_fx, with `options`): static shapes, a graph per shape, each admitted by a probe of its own shape
    (inductor 2.14.1's code for dynamic shapes misread the NVFP4 kernel's broadcast block scales, the probe caught
    it). Called without torch.compile's frame evaluation and guards (~15 us a call, a tenth of a small kernel):
    the key `fused` keeps is the graph's specialisation. Traced outside dynamo, torchao's `to_mx` keeps the clamp
    before its FP8 cast that it drops under dynamo (for Triton's saturating casts): its eager steps."""
    state = {}

    def call(*args):
        if "run" not in state:
            state["run"] = _trace_and_compile(fn, options, args)
        return state["run"](*args)
    return call


def _trace_and_compile(fn, options, args):
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def traced(*tensors):
        full = list(args)  # the constants as this key has them, the tensors as traced
        for i, t in zip(where, tensors):
            full[i] = t
        return fn(*full)
    tensors = [args[i] for i in where]
    _state["fusing"] = True
    try:
        graph = make_fx(traced)(*tensors)
    finally:
        _state["fusing"] = False
    run = compile_fx(graph, tensors, config_patches=dict(options or {}))

    def call(*call_args):
        out = run(*[call_args[i] for i in where])
        return tuple(out) if isinstance(out, list) else out
    return call


def _laid_out_as(p, a):
    """A probe's tensor p in a's dtype and memory layout (the graph it probes is the one a's call runs)."""
    if not isinstance(p, torch.Tensor):
        return p
    out = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    return out.copy_(p)


def _admit(fn, compiled, probes: list[tuple], key: tuple) -> bool:
    """Whether the compiled kernel gives fn's bits on every probe; False (and a warning) where it does not or the
    compiler fails."""
    expected = [fn(*args) for args in probes]  # eager first: fn's imports happen outside the compiler's tracing
    try:
        got = [compiled(*args) for args in probes]
    except Exception as error:  # noqa: BLE001 (no C++ compiler, an unsupported op: the process goes on eager)
        _state["failed"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        warnings.warn(f"the compiled quantizer kernels failed ({_state['failed']}); running them eager (the same "
                      f"bits, ~2x slower); {ENV}=0 skips the attempt", RuntimeWarning, stacklevel=3)
        return False
    if all(same_bits(a, b) for a, b in zip(expected, got)):
        return True
    quiet = tuple(k for k in key if not isinstance(k, tuple))  # once per constants, not per shape
    if (fn, quiet) in _warned:
        return False
    _warned.add((fn, quiet))
    warnings.warn(f"{fn.__qualname__}{quiet[:-1]}: compiled, it gives other bits than eager on its probe on this "
                  f"machine; it runs eager (lab/formats/kernels.py)", RuntimeWarning, stacklevel=3)
    return False


def edge_operands(rows: int, k: int) -> list[torch.Tensor]:
    """Probe operands (FP32, rows x k, k a multiple of 16): the formats' edge cases among random values, in blocks of
    16 along k taken in turn from a 64 x 128 pattern (_edge_pattern), the edge cases first: (finite, with NaN and
    infs)."""
    if k % 16:
        raise ValueError(f"edge operands have k a multiple of 16, got {k}")
    out = []
    for pattern in _edge_pattern():
        blocks = pattern.reshape(-1, 16)
        pick = torch.arange(rows * k // 16) % blocks.shape[0]
        out.append(blocks[pick].reshape(rows, k))
    return out


@functools.cache
def _edge_pattern() -> tuple[torch.Tensor, torch.Tensor]:
    """64 x 128 FP32: rows 0-7 the edge cases (an all-zero block, an FP32 subnormal block, amaxes at, just above and
    just below each element format's max times powers of two: the scale roundings' boundaries and values that clip;
    significands of all ones: EVEN rounding's carry; a ramp of ties on the grids), rows 8-63 random at magnitudes
    from 2^-110 to 2^120. The second is the first with NaN, inf and -inf in its first blocks. From their own
    generator: the caller's random state is untouched."""
    g = torch.Generator().manual_seed(0)
    rows, k = 64, 128
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.linspace(-110.0, 120.0, rows).round())[:, None]
    x[0, :32] = 0.0
    x[1, :32] = torch.randn(32, generator=g) * 2.0 ** -130  # an FP32 subnormal block
    edge = torch.cat([torch.tensor([448.0, 57344.0, 6.0]) * 2.0 ** p for p in (-3, 0, 5)])
    amaxes = torch.cat([edge, torch.nextafter(edge, edge * 2), torch.nextafter(edge, edge * 0)])[:16]
    for i, a in enumerate(amaxes):  # one block of 32 per amax in rows 2-5, its other values below it
        r, b = 2 + i // 4, i % 4
        x[r, b * 32:(b + 1) * 32] = torch.rand(32, generator=g) * a
        x[r, b * 32] = -a if i % 2 else a
    ones = torch.nextafter(torch.tensor(2.0), torch.tensor(0.0))  # 1.111...1 x 2^0
    x[6, :] = ones * torch.exp2(torch.arange(k, dtype=torch.float32) % 40 - 20)
    x[7, :] = (torch.arange(k, dtype=torch.float32) - k / 2) / 16  # ties at every grid of step >= 1/8
    bad = x.clone()
    bad[0, 40], bad[0, 70], bad[0, 5] = float("nan"), float("inf"), float("-inf")
    return x, bad

"""A precision's forward context: ``autocast`` (public: ``lab.autocast``), ``autocast_for`` (the same by a run's
precision name), ``autocast_off`` (every autocast region inside entered disabled) and ``DTYPES``.

On a CPU, FP16 and BF16 autocast are joined by the lab's tensor-core contract (lab/numerics/contract.py,
docs/fp16-cpu.md): each matmul, convolution and attention computes from low-precision operands in FP32 and rounds
its result once, as a GPU's tensor cores do, instead of running the CPU's own FP16 kernels. On CUDA the hardware is
the contract: ``autocast`` is ``torch.autocast``.
"""
from __future__ import annotations

import contextlib

import torch

from lab.numerics.contract import tensor_core_contract

#: the low-precision names of a run's precision and their dtypes (FP32 has none: no autocast)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: what ``autocast`` accepts as a dtype, by name
DTYPE_NAMES = {**DTYPES, "fp32": torch.float32}
#: the devices ``autocast`` accepts (with an index, "cuda:1", or as a torch.device)
DEVICES = ("cpu", "cuda")


def _device_type(device) -> str:
    accepted = "'cpu' or 'cuda' (or 'cuda:N', or a torch.device of either)"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device: expected {accepted}; found {device!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in DEVICES:
        raise ValueError(f"device: expected {accepted}; found {device!r}")
    return kind


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, or one of "
                     f"{', '.join(repr(n) for n in DTYPE_NAMES)}; found {dtype!r}")


class autocast(contextlib.ContextDecorator):
    """``lab.autocast(device, dtype, enabled=True)``: the lab's mixed-precision forward context.

    ``torch.autocast(device_type=device, dtype=dtype, enabled=enabled)`` plus, on a CPU with FP16 or BF16, the
    tensor-core contract (lab.numerics.contract): the same numbers a GPU's tensor cores compute, and FP16 at a few
    casts' cost instead of the CPU's slow native FP16 kernels. On CUDA it is ``torch.autocast``.

    ``device``: "cpu" or "cuda" ("cuda:N" and torch.device too); ``dtype``: torch.float16, torch.bfloat16 or
    torch.float32, or "fp16", "bf16", "fp32". FP32 (and ``enabled=False``) is autocast switched off inside the
    block (no contract, and none of torch's warning about an unsupported dtype): the way to run a region in FP32
    under an enclosing autocast, e.g. ``enabled=not scaler.fp32_fallback``. Bad input raises ValueError naming what
    is accepted, when it is called. Usable as ``with`` (again and nested) and as a decorator, like torch.autocast.
    """

    def __init__(self, device, dtype, *, enabled: bool = True):
        self.device = _device_type(device)
        self.dtype = _dtype(dtype)
        self.enabled = bool(enabled) and self.dtype != torch.float32
        self._stacks: list[contextlib.ExitStack] = []

    def __repr__(self) -> str:
        return f"lab.autocast({self.device!r}, {self.dtype}, enabled={self.enabled})"

    def __enter__(self):
        stack = contextlib.ExitStack()
        if not self.enabled:
            stack.enter_context(torch.autocast(device_type=self.device, enabled=False))
        else:
            stack.enter_context(torch.autocast(device_type=self.device, dtype=self.dtype))
            if self.device == "cpu":
                stack.enter_context(tensor_core_contract())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def autocast_for(precision: str, device: str):
    """The forward-pass context of a run's precision ("fp32", "fp16", "bf16"): nothing for FP32, else
    ``autocast(device, precision)`` (on a CPU with the tensor-core contract)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return autocast(device, DTYPES[precision])


@contextlib.contextmanager
def autocast_off():
    """Run code in FP32 even where it enters autocast itself: every ``torch.autocast`` region entered inside is
    entered disabled. A recorded loop's ``replay=`` closure (lab/run/record.py) holds its own autocast; its FP32
    census replay runs it under this. Restored on exit; single-threaded use (it patches autocast's ``__enter__``)."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave = cls.__enter__, cls.__exit__

    def disabled_enter(self):
        # an instance can outlive the block (accelerate wraps forward in one autocast object): its own setting
        # comes back when the region is left
        self._lab_enabled, self._enabled = self._enabled, False
        return enter(self)

    def restoring_exit(self, *exc):
        try:
            return leave(self, *exc)
        finally:
            if hasattr(self, "_lab_enabled"):
                self._enabled = self._lab_enabled
                del self._lab_enabled

    cls.__enter__, cls.__exit__ = disabled_enter, restoring_exit
    try:
        with torch.autocast("cpu", enabled=False):
            yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave

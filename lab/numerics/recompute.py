"""Gradient checkpointing under the lab's precision: a recompute computes what its forward computed.

torch.utils.checkpoint (``use_reentrant=False``) runs a checkpointed region's forward again inside backward, to
rebuild the tensors autograd saved. It restores the forward's autocast state and the global random generators, but
nothing else the forward ran under: not the lab's CPU tensor-core contract (a TorchFunctionMode,
lab/numerics/contract.py), without which the recomputed activations differ from the forward's (a CheckpointError,
or wrong gradients), nor a recipe layer's per-step state (lab/fp8/linear.py: delayed scaling's amax history, the
census counts, stochastic rounding's generator), which a second forward would advance twice and draw again.

``contexts`` is checkpoint's ``context_fn``: called as the region's forward starts, it returns the forward's context
(a :class:`Tape` that records what each stateful layer call used) and the recompute's (the contract again when the
forward ran under it, and the tape replayed: each layer call gets its forward's values and advances nothing).
``checkpoint`` is torch's checkpoint with both: ``lab.checkpoint(block, x)``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from lab.numerics.contract import tensor_core_contract

# the checkpointed regions being run, outermost first (a recompute runs on the thread that runs backward)
_TAPES: list["Tape"] = []


class Tape:
    """The values a checkpointed region's stateful layer calls used, in call order: recorded by the forward,
    replayed by the recompute (the same calls in the same order)."""

    def __init__(self) -> None:
        self.values: list = []
        self.next: int | None = None  # None while recording; in a recompute, the index the next call gets

    @contextlib.contextmanager
    def running(self, replay: bool):
        self.next = 0 if replay else None
        _TAPES.append(self)
        try:
            yield
        finally:
            _TAPES.pop()

    def take(self):
        if self.next >= len(self.values):
            raise RuntimeError("a checkpointed region's recompute made more stateful layer calls than its forward: "
                               "its forward must take the same path both times")
        self.next += 1
        return self.values[self.next - 1]


def as_in_forward(make):
    """In a checkpoint's recompute: what ``make()`` returned at the forward's same call, where the layer must use it
    and advance nothing (the forward did). Elsewhere None: the layer uses and advances its state as usual; inside a
    checkpointed forward ``make()`` is recorded first. ``make()`` must return what the layer will not change later
    (copies, not views of its buffers); outside checkpointing it is not called."""
    replayed = next((t for t in _TAPES if t.next is not None), None)  # the outermost region being recomputed
    recording = [t for t in _TAPES if t.next is None]  # a region nested in another records what it ran too
    if replayed is None and not recording:
        return None
    value = make() if replayed is None else replayed.take()
    for tape in recording:
        tape.values.append(value)
    return None if replayed is None else value


def _contract_on() -> bool:
    # torch's stack of active TorchFunctionModes (a private helper, there since torch 2.0): the contract is one
    return any(isinstance(m, tensor_core_contract) for m in torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _recompute(tape: Tape, contract: bool):
    with tensor_core_contract() if contract else contextlib.nullcontext(), tape.running(replay=True):
        yield


def contexts():
    """torch.utils.checkpoint's ``context_fn`` (with ``use_reentrant=False``): the forward's context and the
    recompute's, for the precision the forward runs under now (torch itself restores autocast)."""
    tape = Tape()
    return tape.running(replay=False), _recompute(tape, _contract_on())


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)``:
    ``function(*args)`` without its activations kept, recomputed in backward under its forward's precision (the CPU
    tensor-core contract, a recipe layer's scales and stochastic-rounding bits): the same gradients as without."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)

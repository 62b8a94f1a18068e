"""Micro-batches: the backward passes of one optimizer step, counted where they reach the model.

A loop that accumulates gradients runs several forward and backward passes (micro-batches) per optimizer step. What
FP16 flushes is set by each backward's magnitudes, so a census must count like with like: the FP32 replay of one
micro-batch against that micro-batch's own FP16 gradients, not against every micro-batch of the step.
``BackwardCounter`` tells the micro-batches apart without help from the loop: a forward hook on the model hooks its
outputs' gradients, and the first gradient of a backward pass that reaches them (or any census hook, through
:meth:`current`) opens that pass; the autograd engine's end-of-backward callback closes it. A backward that reaches
the model twice (two forwards, one summed loss) counts once.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["BackwardCounter", "rng_state", "set_rng_state"]


def rng_state() -> tuple:
    """The generators a forward pass can draw from (dropout, drop-path): CPU, and CUDA once initialised."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class BackwardCounter:
    """Counts the backward passes through ``model`` since :meth:`reset` (``count``), and keeps the generator state at
    the start of each micro-batch's first forward when ``keep_rng`` is set (a replay of micro-batch ``i`` draws the
    same dropout masks: :meth:`rng_at`)."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.keep_rng = False
        self._open = False          # a backward pass is running and has been counted as micro-batch `count`
        self._rng: dict[int, tuple] = {}
        self._handles = [model.register_forward_pre_hook(self._before_forward),
                         model.register_forward_hook(self._after_forward)]

    def reset(self) -> None:
        self.count, self._rng = 0, {}

    def current(self) -> int:
        """The index of the backward pass now running (call from inside backward: a gradient hook)."""
        if not self._open:
            self._open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._close)
        return self.count

    def _close(self) -> None:
        self._open = False
        self.count += 1

    def rng_at(self, micro: int) -> tuple | None:
        return self._rng.get(micro)

    @contextlib.contextmanager
    def apart(self):
        """Count the backward passes run inside (a replay) on their own: yields a list that holds their number on
        exit; the step's own count and generator states are left as they were."""
        saved, rng, result = self.count, self._rng, []
        self.count, self._rng = 0, {}
        try:
            yield result
        finally:
            result.append(self.count)
            self.count, self._rng = saved, rng

    def _before_forward(self, module, args) -> None:
        if self.keep_rng and torch.is_grad_enabled() and self.count not in self._rng:
            self._rng[self.count] = rng_state()

    def _after_forward(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            for_each_grad_output(output, lambda t: on_gradient(t, self._arrived))

    def _arrived(self, grad) -> None:
        self.current()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


#: skips lab.numerics.contract's TorchFunctionMode on the hooks' own tensor accesses
no_torch_function = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)


def tensors(obj):
    """The tensors in a module's output: a tensor, or lists, tuples and dicts (a ModelOutput) of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


def on_gradient(t: torch.Tensor, fn: Callable[[torch.Tensor | None], None]) -> None:
    """Call ``fn(grad of t)`` when backward computes it: what ``t.register_hook`` does, without its Python
    overhead for a non-leaf, and tied to the autograd node that produced t (so a later in-place op on t,
    timm's in-place activations, does not move it)."""
    node = t.grad_fn
    if node is None:
        t.register_hook(lambda grad: fn(grad) and None)  # a hook that returned a value would replace the gradient
    else:
        nr = t.output_nr
        node.register_prehook(lambda grad_outputs: fn(grad_outputs[nr]) and None)


def for_each_grad_output(output, fn: Callable[[torch.Tensor], None]) -> None:
    """``fn(t)`` for each tensor of a module's output that takes part in backward."""
    with no_torch_function():
        for t in tensors(output):
            if t.requires_grad:
                fn(t)

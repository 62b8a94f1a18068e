"""The forward range: the first module, in forward order, whose output left FP16's range.

No loss scale reaches the forward pass, so a non-finite loss in FP16 means some module produced a value beyond 65504
(or inf/NaN). Two ways to find it: a replay of an overflow step with range hooks (lab/numerics/monitor.py), or, in a
loop recorded without a replay, :class:`ForwardProbe`: armed after an overflow step, it measures the largest output
magnitude of every module during the next training forward, in the order the modules finish (one forward's cost; the
values stay on the device until the recorder's next read of its logged values), and reports the first beyond FP16's
range.
"""
from __future__ import annotations

import functools

import torch

from lab.core.fp16 import MAX as FP16_MAX  # 65504 (torch.finfo): an output beyond it cannot be held in FP16
from lab.numerics.micro import no_torch_function, tensors

__all__ = ["ForwardProbe", "Probed", "output_amax", "range_hooks", "first_beyond"]


def output_amax(output) -> torch.Tensor | None:
    """The largest magnitude among a module's floating-point outputs, as an FP32 scalar on their device (NaN when one
    holds a NaN); None without one."""
    with no_torch_function(), torch.no_grad():
        found = [t.detach().abs().amax().float() for t in tensors(output) if t.is_floating_point() and t.numel()]
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).amax()


def range_hooks(model: torch.nn.Module, outputs: list, weights: list) -> list:
    """Forward hooks on every module of ``model`` that append (name, class, max |output|) to ``outputs`` and the max
    |own weights| (0 without any) to ``weights``, in the order the modules finish their forward. Returns the handles."""
    def hook(name, module, args, output):
        amax = output_amax(output)
        if amax is not None:
            outputs.append((name, type(module).__name__, amax))
            own = list(module.parameters(recurse=False))
            weights.append(output_amax(own) if own else torch.zeros((), device=amax.device))
    return [m.register_forward_hook(functools.partial(hook, name or "__root__")) for name, m in model.named_modules()]


def first_beyond(outputs: list, amaxes: list[float], weight_amaxes: list[float]) -> tuple | None:
    """(module, class, max |output|, max |own weights|) of the first output beyond 65504 (inf and NaN included)."""
    return next(((name, kind, a, w) for (name, kind, _), a, w in zip(outputs, amaxes, weight_amaxes)
                 if not a <= FP16_MAX), None)


class Probed:
    """One probed forward's measures, still on the device: :meth:`values` to read (with other values, in one
    transfer), then :meth:`first_beyond` with what was read."""

    def __init__(self, outputs: list, weights: list):
        self.outputs, self.weights = outputs, weights

    def values(self) -> list[torch.Tensor]:
        return [a for _, _, a in self.outputs] + self.weights

    def first_beyond(self, values: list[float]) -> tuple | None:
        n = len(self.outputs)
        return first_beyond(self.outputs, values[:n], values[n:])


class ForwardProbe:
    """Measures the forward range of the next training forward of ``model`` once :meth:`arm` is called (at most
    ``limit`` times per run). :meth:`take` hands over the last probed forward (a :class:`Probed`, or None);
    ``probes`` counts the probed forwards."""

    def __init__(self, model: torch.nn.Module, limit: int = 32):
        self.model, self.limit = model, limit
        self.probes = 0
        self.found: Probed | None = None
        self._handles: list = []
        self._outputs: list = []
        self._weights: list = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Measure the model's next forward under grad mode (a training forward, not an evaluation)."""
        if self.armed or self.probes >= self.limit:
            return
        self._outputs, self._weights = [], []
        self._handles = range_hooks(self.model, self._outputs, self._weights)
        self._handles.append(self.model.register_forward_hook(self._done))  # registered last: runs after the root's

    def _done(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation forward: wait for the next training one
            self._outputs.clear()
            self._weights.clear()
            return
        self.disarm()
        self.probes += 1
        self.found = Probed(self._outputs, self._weights)
        self._outputs, self._weights = [], []

    def take(self) -> Probed | None:
        found, self.found = self.found, None
        return found

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

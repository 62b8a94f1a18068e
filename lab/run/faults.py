"""Planted faults: inf or NaN put at known places, so that a run's counting can be checked against the rule.

``train.faults`` in a config lists them (validated by the schema and by :func:`parse`)::

    faults:
      - {step: 37, into: activation_grad, module: blocks.2.attn.proj, value: inf}
      - {step: 40, into: param_grad, param: head.weight, value: nan}
      - {step: 45, micro: 1, into: loss, value: inf}
      - {step: 50, into: activation, module: blocks.1.mlp.fc2, value: inf}

``step`` is the 0-based optimizer step (steps.csv's ``step``), ``micro`` the micro-batch within it (default 0;
below ``train.accum_steps``; in a distributed run, ``rank`` plants on that rank only). What is planted:

* ``activation_grad``: the gradient that backward delivers to the named leaf module's output is replaced by a
  tensor filled with ``value``, as if the backward of the module consuming that output had overflowed. The
  monitor's attribution names that module, source ``activation_grad``. Leaf modules only: the monitor watches
  leaf outputs, and a container's output is one of its leaves' outputs.
* ``param_grad``: the named parameter's gradient from that micro-batch is filled with ``value`` (attribution:
  the module owning it, source ``param_grad``).
  Sharded (`parallel: fsdp`), where FSDP2 reduce-scatters the gradient inside the backward: this rank's shard of
  the reduced gradient, at the step's optimizer step (``plant_shards``), so a fault naming a ``rank`` lands in that
  rank's shard only (configs/fsdp-unscale.yaml's case).
* ``loss``: the micro-batch's loss is multiplied by ``value``: the loss is non-finite and so is every gradient
  backward computes from it (attribution: the leaf that produced the model's output, ``activation_grad``).
* ``activation``: ``value`` is added to the named module's forward output (any module), as a forward pass whose
  output left FP16's range (T5's feed-forward output past 65504, transformers#5651). The replay of the skipped
  step measures the forward range: steps.csv's ``forward_overflow_module`` names that module.

A whole tensor is filled rather than one element, so that no later operation can mask the fault (a ReLU's
backward zeroes one element whose input was negative). A fault plants again when the monitor replays an
overflow step for attribution, because the replay runs the same step's micro-batches. Only the armed
(step, micro) pays anything: other steps run the bare model.
"""
from __future__ import annotations

import torch

# the fault list's format and checks (core: the study's validation uses them too); re-exported here
from lab.core.fault_spec import (INTO, VALUES, Fault, check, check_ranks, check_targets, parse,  # noqa: F401
                                 study_problems)
from lab.core.shards import local_shard


class FaultPlanter:
    """Hooks a model so that ``arm(step, micro)`` plants that micro-batch's faults; ``planted`` records each
    fault that fired (once per fault, whatever the replays)."""

    def __init__(self, model: torch.nn.Module, faults: list[Fault], rank: int = 0):
        self.faults = list(faults)
        self.rank = rank
        self.planted: list[Fault] = []
        self._armed: list[Fault] = []
        self._handles = []
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        for target in sorted({f.target for f in self.faults if f.into == "activation_grad"}):
            self._handles.append(modules[target].register_forward_hook(self._forward_hook(target)))
        # sharded parameters (FSDP2's DTensors) are not in the backward's graph: their shards are planted at the
        # optimizer step instead (plant_shards)
        self._sharded = {name: p for name, p in params.items() if local_shard(p) is not p}
        for target in sorted({f.target for f in self.faults if f.into == "param_grad"} - set(self._sharded)):
            self._handles.append(params[target].register_hook(self._param_hook(target)))
        for target in sorted({f.target for f in self.faults if f.into == "activation"}):
            self._handles.append(modules[target].register_forward_hook(self._output_hook(target)))

    @property
    def steps(self) -> list[int]:
        return sorted({f.step for f in self.faults})

    def arm(self, step: int, micro: int) -> None:
        self._armed = [f for f in self.faults if f.step == step and f.micro == micro and f.rank in (None, self.rank)]

    def disarm(self) -> None:
        self._armed = []

    def _fired(self, f: Fault) -> float:
        if f not in self.planted:
            self.planted.append(f)
        return VALUES[f.value]

    def _armed_for(self, into: str, target: str) -> Fault | None:
        return next((f for f in self._armed if f.into == into and f.target == target), None)

    def _forward_hook(self, target: str):
        def hook(module, args, output):
            f = self._armed_for("activation_grad", target) if self._armed else None
            if f is None or not isinstance(output, torch.Tensor) or output.grad_fn is None:
                return
            # a pre-hook on the node that produced the output replaces the gradient arriving there; registered
            # in this forward hook, which runs before the monitor's (installed later), it comes first, so the
            # monitor's hook on the same node sees the planted gradient
            value, nr = self._fired(f), output.output_nr

            def plant(grad_outputs):
                return tuple(torch.full_like(g, value) if i == nr and g is not None else g
                             for i, g in enumerate(grad_outputs))
            output.grad_fn.register_prehook(plant)
        return hook

    def _output_hook(self, target: str):
        def hook(module, args, output):
            f = self._armed_for("activation", target) if self._armed else None
            if f is None or not isinstance(output, torch.Tensor):
                return None
            return output + torch.full((), self._fired(f), dtype=output.dtype, device=output.device)
        return hook

    def _param_hook(self, target: str):
        def hook(grad):
            f = self._armed_for("param_grad", target) if self._armed else None
            return None if f is None else torch.full_like(grad, self._fired(f))
        return hook

    def plant_shards(self, step: int) -> None:
        """Sharded runs, after the step's backward (its reduce-scatter) and before unscale_: this rank's shard of each
        param_grad fault's parameter gradient filled with its value."""
        for f in self.faults:
            p = self._sharded.get(f.target)
            if (f.into == "param_grad" and p is not None and f.step == step and f.rank in (None, self.rank)
                    and p.grad is not None):
                local_shard(p.grad).fill_(self._fired(f))

    def plant_loss(self, loss: torch.Tensor) -> torch.Tensor:
        f = self._armed_for("loss", "") if self._armed else None
        if f is None:
            return loss
        return loss * torch.full((), self._fired(f), dtype=loss.dtype, device=loss.device)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> dict:
        return {"planted": [f.to_dict() for f in self.planted]}

    def load_state_dict(self, state: dict) -> None:
        self.planted = [Fault(**d) for d in state["planted"]]

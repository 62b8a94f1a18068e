"""Every quantized linear's amax at every step: fp8_amax.csv (``step, layer, role, amax``; role input, weight or
grad_output), the history every amax predictor learns from and is judged on (lab/scaling/learning, docs/
controllers.md). The lab's recipe layers keep their step's amaxes themselves (RecipeLinear.record_amax: the largest
over a step's micro-batches, from the operands their GEMMs quantize); torchao's Float8Linear layers get hooks that
take the same three amaxes (the input as torchao quantizes it, the weight, the output gradient). Kept on the device,
fetched once when written; a checkpoint keeps them (``state_dict``), so a resumed run writes the same file."""
from __future__ import annotations

from pathlib import Path

import torch

from lab.core import files
from lab.fp8.linear import ROLE_KIND, recipe_layers
from lab.fp8.model_census import torchao_layers

FILE = "fp8_amax.csv"
#: fp8_amax.csv's columns, in order, and what each holds (docs/fp8.md's table is generated from this)
COLUMN_DOCS = {"step": "every optimizer step", "layer": "the quantized linear's module name",
               "role": "input, weight or grad_output", "amax": "the operand's largest magnitude at that step (over "
               "its micro-batches)"}
COLUMNS = tuple(COLUMN_DOCS)
ROLES = sorted(ROLE_KIND, key=ROLE_KIND.get)  # input, weight, grad_output: the order of a step's row


class AmaxRecord:
    def __init__(self, model: torch.nn.Module):
        self.layers = recipe_layers(model)
        self.hooked = [(name, mod) for name, mod, _ in torchao_layers(model)]
        self.names = [m.lab_name for m in self.layers] + [name for name, _ in self.hooked]
        self.on, self.step = True, None
        self.steps: list[int] = []
        self.rows: list[torch.Tensor] = []  # per step (layers, roles), on the device until written
        device = next(model.parameters()).device
        self.device = device  # where a step's row is made
        self._taken: list = []  # the torchao layers' (layer, role, amax) this step
        self._keys, self._index = None, None  # the last step's (layer, role) of each amax taken, as a tensor
        self._handles = []
        for layer in self.layers:
            layer.record_amax()
        for i, (_, mod) in enumerate(self.hooked):
            self._handles += [mod.register_forward_pre_hook(self._forward(i)),
                              mod.register_full_backward_pre_hook(self._backward(i))]

    def __bool__(self) -> bool:
        return bool(self.names)

    def _take(self, i: int, role: str, t: torch.Tensor) -> None:
        if self.on and self.step is not None:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                low, high = t.detach().aminmax()
                self._taken.append((len(self.layers) + i, ROLE_KIND[role], torch.maximum(-low, high)))

    def _forward(self, i):
        def hook(module, args):
            if self.on and self.step is not None and torch.is_grad_enabled() and module.training:
                # the input as torchao casts it: lab.record casts it to the autocast dtype before this hook runs
                # (torchao_autocast_input), as a GPU's autocast gives it (tests/test_controllers.py)
                self._take(i, "input", args[0])
                self._take(i, "weight", module.weight)
        return hook

    def _backward(self, i):
        def hook(module, grad_output):
            if self.on and self.step is not None:
                self._take(i, "grad_output", grad_output[0])
        return hook

    def record(self, on: bool) -> None:
        """Keep recording (the default) or stop: what the cost benchmark compares."""
        self.on = on
        for layer in self.layers:
            layer.record_amax(on)

    def begin_step(self, step: int) -> None:
        self.step = step
        self._taken.clear()
        for layer in self.layers:
            if layer.amax_taken is not None:
                layer.amax_taken.clear()

    def end_step(self, keep: bool = True) -> None:
        if self.on and self.step is not None and keep and self.names:
            self.steps.append(self.step)
            self.rows.append(self._reduce())
        self.step = None

    def _reduce(self) -> torch.Tensor:
        """This step's (layers, roles) amaxes from every operand's amax taken: the largest per (layer, role) over the
        step's micro-batches, in a few exact ops for the whole model (NaN and inf kept; abs: -0.0 written as 0.0),
        outside the CPU contract's function mode; the index is made again only when the operands taken change."""
        taken = [(k, r, a) for k, m in enumerate(self.layers) for r, a in (m.amax_taken or [])]
        taken += self._taken
        with torch.no_grad(), torch._C.DisableTorchFunction():
            out = torch.zeros(len(self.names) * 3, device=self.device)
            if taken:
                keys = [k * 3 + r for k, r, _ in taken]
                if keys != self._keys:
                    self._keys, self._index = keys, torch.tensor(keys, device=out.device)
                out.scatter_reduce_(0, self._index, torch.stack([a for *_, a in taken]).float().abs(), "amax",
                                    include_self=True)
            return out.reshape(len(self.names), 3)

    def table(self) -> tuple[list[int], torch.Tensor]:
        """(steps, amax (steps, layers, roles) on the CPU): what the file holds."""
        rows = torch.stack(self.rows).cpu() if self.rows else torch.zeros(0, len(self.names), 3)
        return list(self.steps), rows

    def write(self, out_dir) -> Path | None:
        steps, amax = self.table()
        if not steps:
            return None
        lines = [",".join(COLUMNS)]
        for i, step in enumerate(steps):
            for j, name in enumerate(self.names):
                lines += [f"{step},{name},{role},{float(amax[i, j, r])!r}" for r, role in enumerate(ROLES)]
        path = Path(out_dir) / FILE
        files.atomic_write_text(path, "\n".join(lines) + "\n")
        return path

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "rows": self.table()[1]}

    def load_state_dict(self, state: dict) -> None:
        device = self.device
        self.steps = list(state.get("steps", []))
        self.rows = [row.to(device) for row in state.get("rows", [])]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

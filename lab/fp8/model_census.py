"""The FP8 census of a model (lab/fp8/census.py's rows): its RecipeLinear layers count their own operands; torchao's
`Float8Linear` layers (`convert_to_float8_training`) are observed through module hooks, installed on census steps
only, that quantize the same operands with the lab's equal quantizers (bit for bit the same as torchao's casts:
tests/test_fp8_linear.py), so the census says what torchao's GEMMs were given.

    census = Fp8Census(model, every=100)
    census.begin_step(step)   # before the forward
    ...forward, backward...
    census.end_step()         # after the backward: a census step's rows fetched in one transfer
    census.write(out_dir)     # fp8_census.csv
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lab.core import files
from lab.fp8.recipe import create_recipe
from lab.fp8.census import COLUMNS, FILE, Rows, backward_operands, forward_operands, operand_stats
from lab.fp8.linear import recipe_layers
from lab.formats import quantize

#: torchao's float8 recipe names -> the lab's recipe whose GEMMs equal them (tests/test_fp8_linear.py)
TORCHAO_RECIPES = {"tensorwise": "fp8-current", "rowwise": "fp8-rowwise", "rowwise_with_gw_hp": "fp8-rowwise-gw-hp"}
OPERANDS = "fp8_operands.pt"
KEEP_ROWS = 2048  # tokens kept of each input and output gradient for the replay (16 tiles of 128)


def _torchao_recipe(config):
    """The lab's Recipe equal to a Float8Linear's config (its `emulate` aside), or None for one it does not know."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    plain = dataclasses.replace(config, emulate=False)
    for name, lab_name in TORCHAO_RECIPES.items():
        if plain == Float8LinearConfig.from_recipe_name(name):
            return create_recipe(lab_name)
    return None


def torchao_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, module, lab Recipe) of each torchao Float8Linear in model; a config the lab has no recipe for is
    refused (its census would be of other casts than the ones torchao made)."""
    import sys
    if "torchao.float8" not in sys.modules:  # no model was converted by torchao (and importing it costs seconds)
        return []
    from torchao.float8.float8_linear import Float8Linear
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            recipe = _torchao_recipe(mod.config)
            if recipe is None:
                raise ValueError(f"{name}: a Float8Linear config the lab's FP8 census does not know (it knows "
                                 f"torchao's {', '.join(TORCHAO_RECIPES)} recipes)")
            out.append((name, mod, recipe))
    return out


def torchao_autocast_input(model: torch.nn.Module, device: str) -> int:
    """torchao's ``Float8Linear`` casts its input to the autocast dtype under CUDA autocast only (its forward asks
    ``torch.is_autocast_enabled()``, CUDA's, and takes CUDA's dtype): under CPU autocast an FP32 input (a LayerNorm's
    or RMSNorm's output, which autocast keeps in FP32) reaches the float8 cast in FP32, its scale taken from FP32
    values, where a GPU would have rounded it to BF16/FP16 first. A forward pre-hook on each Float8Linear (first in
    line: the FP8 census sees what the layer is given) casts it as CUDA autocast would, while CPU autocast is on
    (nothing in FP32, nothing on a GPU, nothing in lab.record's FP32 replays). Once per layer; returns how many layers
    are hooked."""
    import sys
    if device != "cpu" or "torchao.float8" not in sys.modules:  # no model was converted by torchao
        return 0
    from torchao.float8.float8_linear import Float8Linear
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in layers:
        if getattr(m, "_lab_autocast_input", None) is None:
            m._lab_autocast_input = m.register_forward_pre_hook(_autocast_input, prepend=True)
    return len(layers)


def _autocast_input(module, args):
    if not args or not torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return None
    x, dtype = args[0], torch.get_autocast_dtype("cpu")
    if (not isinstance(x, torch.Tensor) or type(x).__module__.startswith("torchao.")  # already float8: as torchao
            or not x.is_floating_point() or x.dtype == dtype):
        return None
    return (x.to(dtype), *args[1:])


class Fp8Census:
    """The census switch for the model's recipe layers and the hooks on its torchao layers (module docstring)."""

    def __init__(self, model: torch.nn.Module, every: int, keep_operands: bool = True):
        self.every, self.keep_operands = every, keep_operands  # operands: lab.record's, for `lab replay`
        self.layers = recipe_layers(model)
        self.torchao = torchao_layers(model)
        self.rows, self.taken, self.step, self.hooks, self.off = Rows(), [], None, [], False
        self.operands: dict = {}  # the latest census step's operands, per layer: what `lab replay` quantizes again
        self.step_operands: dict = {}

    def __bool__(self) -> bool:
        return bool(self.layers or self.torchao)

    def recipe(self):
        """(the Recipe the model's FP8 layers run, whose layers run it: "lab" or "torchao", whose configs the lab
        knows as its equal recipes); None without FP8 layers."""
        if self.layers:
            return self.layers[0].recipe, "lab"
        return (self.torchao[0][2], "torchao") if self.torchao else None

    def begin_step(self, step: int) -> bool:
        """Turn the census on for this step if it is a census step; returns whether it is."""
        on = bool(self.every) and step % self.every == 0
        self.step = step if on else None
        for layer in self.layers:
            layer.census = on
            layer.census_rows, layer.census_step = (self.rows if on else None), step
        if on:
            self.step_operands = {}
            for name, mod, recipe in self.torchao:
                self._hook(name, mod, recipe, step)
            if self.keep_operands:
                for name, mod in [(layer.lab_name, layer) for layer in self.layers] + [(n, m) for n, m, _ in
                                                                                       self.torchao]:
                    self._keep(name, mod, step)
        return on

    @contextlib.contextmanager
    def paused(self):
        """No rows while a replay runs the step's forward and backward again (lab.record's FP32 replay and
        overflow attribution): the census counts the training step's operands once."""
        census = [layer.census for layer in self.layers]
        self.off = True
        for layer in self.layers:
            layer.census = False
        try:
            yield
        finally:
            self.off = False
            for layer, on in zip(self.layers, census):
                layer.census = on

    def end_step(self, keep: bool = True) -> None:
        """The step's census off and its rows taken (`keep` False: dropped, a step that was never recorded)."""
        if not keep:
            self.rows.pending.clear()
        elif self.step is not None and self.step_operands:
            self.operands = self.step_operands  # the latest recorded census step's
        for layer in self.layers:
            layer.census, layer.census_rows = False, None
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        if self.step is not None:
            self.taken += self.rows.take()  # one transfer for the step's rows
        self.step = None

    def _hook(self, name: str, mod: torch.nn.Module, recipe, step: int) -> None:
        """Quantize a torchao layer's operands as its GEMMs did: the forward's at its forward, the gradients' at
        its backward (the input kept from the forward, this step only)."""
        seen = {}

        def forward(module, args):
            if self.off or not torch.is_grad_enabled():  # an evaluation's forward (no_grad): not the step's
                return
            x = args[0]
            if torch.is_autocast_enabled():  # torchao's own cast (Float8Linear.forward): CUDA's autocast dtype
                x = x.to(torch.get_autocast_gpu_dtype())
            seen["x"] = x2 = x.detach().reshape(-1, x.shape[-1])
            self._count(name, step, forward_operands(recipe, x2, module.weight.detach()))

        def backward(module, grad_output):
            if self.off:
                return
            go = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1])
            self._count(name, step, backward_operands(recipe, go, module.weight.detach(), seen.pop("x", None)))

        self.hooks += [mod.register_forward_pre_hook(forward), mod.register_full_backward_pre_hook(backward)]

    def _keep(self, name: str, mod: torch.nn.Module, step: int) -> None:
        """Keep a copy of the layer's input, weight and output gradient of this census step (at most KEEP_ROWS
        tokens of each: whole 128-row tiles), for `lab replay` to quantize under every recipe."""
        kept = {"step": step}

        def forward(module, args):
            if not self.off and torch.is_grad_enabled():
                x = args[0].detach()
                device = x.device.type
                if torch.is_autocast_enabled(device):  # what the layer quantizes: its input as autocast casts it
                    x = x.to(torch.get_autocast_dtype(device))
                kept["x"] = x.reshape(-1, x.shape[-1])[:KEEP_ROWS].float().clone()
                kept["w"] = module.weight.detach().float().clone()

        def backward(module, grad_output):
            if not self.off and "x" in kept:
                go = grad_output[0].detach()
                kept["go"] = go.reshape(-1, go.shape[-1])[:KEEP_ROWS].float().clone()
                self.step_operands[name] = kept
        self.hooks += [mod.register_forward_pre_hook(forward), mod.register_full_backward_pre_hook(backward)]

    @torch.no_grad()
    def _count(self, name: str, step: int, operands) -> None:
        for gemm, role, t, fmt, k_dim in operands:  # those quantized (census.forward_operands, backward_operands)
            q = quantize(t, fmt, k_dim, stats=True)
            self.rows.add(step, name, gemm, role, fmt, operand_stats(t, q, fmt, k_dim))

    # --- the run's file and its checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rows": list(self.taken)}

    def load_state_dict(self, state: dict) -> None:
        self.taken = list(state.get("rows", []))

    def write(self, out_dir: str | Path) -> Path | None:
        """fp8_census.csv and the latest census step's operands (fp8_operands.pt, for `lab replay`), atomically;
        None when there is nothing to write."""
        if not self.taken:
            return None
        if self.operands:
            tmp = Path(out_dir) / (OPERANDS + ".tmp")
            torch.save(self.operands, tmp)
            tmp.replace(Path(out_dir) / OPERANDS)
        import pandas as pd
        path = Path(out_dir) / FILE
        files.atomic_write_text(path, pd.DataFrame(self.taken, columns=list(COLUMNS)).to_csv(
            index=False, lineterminator="\n"))
        return path

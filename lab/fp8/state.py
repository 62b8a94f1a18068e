"""A run's recipe state: what a checkpoint keeps of the recipe layers (delayed scaling's amax histories, the census
counts and rows, the stochastic-rounding generator, the amaxes recorded so far) and the census switch, on at census
steps only (no host sync on others). The run's metrics get each tensor kind's saturated and flushed shares over the
census steps; its fp8_census.csv each quantized operand's row per census step (lab/fp8/census.py); its fp8_amax.csv
every converted linear's input, weight and output-gradient amax at every step (kept on the device, fetched once at
the end): the histories every amax predictor learns from and is judged on (lab/scaling/learning)."""
from __future__ import annotations

import torch

from lab.fp8.amax_record import AmaxRecord
from lab.fp8.linear import KINDS, predict_all, recipe_layers
from lab.fp8.model_census import Fp8Census


class RecipeState:
    def __init__(self, model, recipe, seed: int, census_every: int, device: str = "cpu"):
        self.recipe, self.every = recipe, census_every
        self.layers = recipe_layers(model)
        self.kept = getattr(model, "lab_recipe_kept", [])  # linears left in BF16 (keep_high, or not whole blocks)
        # stochastic rounding draws from a generator of its own: the global stream (data order, dropout) stays the
        # one every other mode of this seed draws
        self.generator = torch.Generator(device=device).manual_seed(int(seed) * 1_000_003 + 17)
        for layer in self.layers:
            layer.generator = self.generator
        self.census_steps = 0
        # a study's runs keep the census rows, not the operands `lab replay` needs (~20 MB a run): lab.record keeps them
        self.census = Fp8Census(model, census_every, keep_operands=False)
        self.amax = AmaxRecord(model)  # fp8_amax.csv: every linear's amaxes at every step

    def begin_step(self, step: int) -> None:
        predict_all(self.layers)
        self.amax.begin_step(step)
        self.census_steps += int(self.census.begin_step(step))

    def end_step(self) -> None:
        self.census.end_step()
        self.amax.end_step()

    def write(self, out_dir) -> None:
        """fp8_census.csv: each quantized operand's census row per census step; fp8_amax.csv: every step's amax of
        every converted linear's three roles (one transfer), atomically."""
        self.census.write(out_dir)
        self.amax.write(out_dir)

    def state_dict(self) -> dict:
        return {"histories": {m.lab_name: m.amax_history.clone() for m in self.layers},
                "scale_amaxes": {m.lab_name: m.scale_amax.clone() for m in self.layers},
                "counts": {m.lab_name: m.counts.clone() for m in self.layers},
                "generator": self.generator.get_state(), "census_steps": self.census_steps,
                "census_rows": self.census.state_dict()["rows"],
                "amax": self.amax.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for m in self.layers:
            m.amax_history.copy_(state["histories"][m.lab_name])
            if "scale_amaxes" in state:  # none in a checkpoint from before the lab kept them: 0, scale 1 if needed
                m.scale_amax = state["scale_amaxes"][m.lab_name].to(m.scale_amax.device).clone()
            m.counts.copy_(state["counts"][m.lab_name])
        self.generator.set_state(state["generator"])
        self.census_steps = state["census_steps"]
        self.census.load_state_dict({"rows": state.get("census_rows", [])})  # none in a checkpoint from before it
        self.amax.load_state_dict(state.get("amax", {}))  # none in a checkpoint from before the lab kept them

    def metrics(self) -> dict:
        """recipe, layers converted, and per tensor kind (activation, weight, gradient) over the census steps:
        saturated (share of elements clipped at the format's maximum) and flushed (share of non-zero elements
        quantized to zero), in percent."""
        total = sum(m.counts for m in self.layers).tolist() if self.layers else [[0] * 4] * 3
        out = {"recipe": self.recipe.name, "recipe_layers": len(self.layers), "recipe_census_steps": self.census_steps,
               "recipe_kept_high": list(self.kept)}
        for kind, (saturated, flushed, nonzero, numel) in zip(KINDS, total):
            out[f"saturated_{kind}_pct"] = 100.0 * saturated / numel if numel else None
            out[f"flushed_{kind}_pct"] = 100.0 * flushed / nonzero if nonzero else None
        return out

"""A run's recipe state: what a checkpoint keeps of the recipe layers (delayed scaling's amax histories, the census
counts and rows, the stochastic-rounding generator, the amaxes recorded so far) and the census switch, on at census
steps only (no host sync on others). The run's metrics get each tensor kind's saturated and flushed shares over the
census steps; its fp8_census.csv each quantized operand's row per census step (lab/fp8/census.py); its fp8_amax.csv
every converted linear's input, weight and output-gradient amax at every step (kept on the device, fetched once at
the end): the histories every amax predictor learns from and is judged on (lab/scaling/learning)."""
from __future__ import annotations

from pathlib import Path

import torch

from lab.core import files
from lab.fp8.linear import KINDS, ROLE_KIND, recipe_layers
from lab.fp8.model_census import Fp8Census

AMAX_FILE = "fp8_amax.csv"
AMAX_COLUMNS = ("step", "layer", "role", "amax")


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
        for layer in self.layers:
            layer.record_amax()
        self.amax_steps: list[int] = []
        self.amax_rows: list[torch.Tensor] = []  # per step (layers, roles), on the device until written
        self.step = None

    def record_amax(self, on: bool) -> None:
        """Keep recording every step's amaxes (on by default), or stop (what the cost benchmark compares)."""
        for layer in self.layers:
            layer.record_amax(on)

    def begin_step(self, step: int) -> None:
        self.step = step
        for layer in self.layers:
            if layer.amax_now is not None:
                layer.amax_now.zero_()
        self.census_steps += int(self.census.begin_step(step))

    def end_step(self) -> None:
        self.census.end_step()
        if self.layers and self.step is not None and self.layers[0].amax_now is not None:
            self.amax_steps.append(self.step)
            self.amax_rows.append(torch.stack([layer.amax_now for layer in self.layers]).clone())

    def amax_table(self) -> tuple[list[int], torch.Tensor]:
        """(steps, amax (steps, layers, roles) on the CPU): what fp8_amax.csv holds."""
        rows = torch.stack(self.amax_rows).cpu() if self.amax_rows else torch.zeros(0, len(self.layers), 3)
        return list(self.amax_steps), rows

    def write(self, out_dir) -> None:
        """fp8_census.csv: each quantized operand's census row per census step; fp8_amax.csv: every step's amax of
        every converted linear's three roles (one transfer), atomically."""
        self.census.write(out_dir)
        steps, amax = self.amax_table()
        if not steps:
            return
        roles = sorted(ROLE_KIND, key=ROLE_KIND.get)
        lines = [",".join(AMAX_COLUMNS)]
        for i, step in enumerate(steps):
            for j, layer in enumerate(self.layers):
                lines += [f"{step},{layer.lab_name},{role},{float(amax[i, j, r])!r}" for r, role in enumerate(roles)]
        files.atomic_write_text(Path(out_dir) / AMAX_FILE, "\n".join(lines) + "\n")

    def state_dict(self) -> dict:
        return {"histories": {m.lab_name: m.amax_history.clone() for m in self.layers},
                "counts": {m.lab_name: m.counts.clone() for m in self.layers},
                "generator": self.generator.get_state(), "census_steps": self.census_steps,
                "census_rows": self.census.state_dict()["rows"],
                "amax": {"steps": list(self.amax_steps), "rows": self.amax_table()[1]}}

    def load_state_dict(self, state: dict) -> None:
        for m in self.layers:
            m.amax_history.copy_(state["histories"][m.lab_name])
            m.counts.copy_(state["counts"][m.lab_name])
        self.generator.set_state(state["generator"])
        self.census_steps = state["census_steps"]
        self.census.load_state_dict({"rows": state.get("census_rows", [])})  # none in a checkpoint from before it
        amax = state.get("amax", {"steps": [], "rows": []})  # none in a checkpoint from before the lab kept them
        device = self.layers[0].weight.device if self.layers else "cpu"
        self.amax_steps = list(amax["steps"])
        self.amax_rows = [row.to(device) for row in amax["rows"]]

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

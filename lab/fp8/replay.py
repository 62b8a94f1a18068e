"""Every recipe replayed on an FP8 run's own tensors: `python -m lab replay RUN_DIR` on a run with fp8_operands.pt
(its latest census step's inputs, weights and output gradients, kept by lab/fp8/model_census.py) quantizes them as each
registered recipe's GEMMs would and gives each recipe's saturated, flushed and subnormal shares and relative error per
tensor kind, as the FP16 replay gives each policy's overflows.

Exact where the recipe's quantization is: the same quantizers on the same tensors. An approximation for delayed
scaling, whose history this run did not keep for another recipe: its amax history is the run's own census amaxes of
that operand before the replayed step (census steps only), and a recipe's effect on the training that follows is not
replayed (the tensors are the recorded run's).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from lab.core import runfiles
from lab.fp8.recipe import RECIPES, _load_recipe_files, create_recipe
from lab.fp8.census import KIND, NUMBERS, backward_operands, forward_operands, operand_stats, read_rows
from lab.fp8.model_census import OPERANDS
from lab.formats import quantize

COLUMNS = ["recipe", "operands"] + [f"{m}_{k}" for k in KIND.values()
                                    for m in ("saturated", "flushed", "subnormal", "rel_error")] + ["nonfinite"]


class Fp8ReplayError(ValueError):
    """The run directory holds no FP8 operands to replay (not an FP8 run, or recorded before the lab kept them)."""


def _operands(recipe, kept: dict) -> list[tuple]:
    """Each quantized operand of one layer's three GEMMs under `recipe`, on the layer's kept tensors."""
    return (forward_operands(recipe, kept["x"], kept["w"])
            + backward_operands(recipe, kept["go"], kept["w"], kept["x"]))


def _histories(run_dir: Path, step: int, census: list[dict] | None = None) -> dict:
    """(layer, role) -> the largest census amax of that operand before `step`: delayed scaling's history, replayed;
    `census`: the run's rows where the caller read them already."""
    out: dict = {}
    for r in census if census is not None else read_rows(run_dir, ("step", "layer", "role", "amax")) or []:
        if r["step"] < step:
            key = (r["layer"], r["role"])
            out[key] = max(out.get(key, -math.inf), r["amax"])
    return {k: torch.tensor(v) for k, v in out.items()}


@torch.no_grad()
def replay_recipe(recipe, operands: dict, histories: dict, gemms: set | None = None) -> dict:
    """One recipe over every kept layer: its shares per tensor kind (percent) and its mean relative error. `gemms`:
    the (layer, GEMM) pairs the run computed (its census step's rows), None for all: a first layer whose input needs
    no gradient never runs its input-gradient GEMM, and a replay of it would count operands the run never had."""
    sums: dict = {}
    generator = torch.Generator().manual_seed(0)
    for layer, kept in operands.items():
        for gemm, role, t, fmt, k_dim in _operands(recipe, kept):
            if gemms is not None and (layer, gemm) not in gemms:
                continue
            if fmt.hadamard:
                from lab.formats.hadamard import random_hadamard
                from lab.fp8.linear import _signs
                t = random_hadamard(t, k_dim, _signs(layer), torch.float32)
            history = histories.get((layer, role), torch.tensor(0.0)) if fmt.scale == "delayed" else None
            q = quantize(t, fmt, k_dim, history_amax=history, margin=recipe.margin, generator=generator, stats=True)
            n = dict(zip(NUMBERS, operand_stats(t, q, fmt, k_dim, history).tolist()))
            acc = sums.setdefault(KIND[role], {"numel": 0, "nonzero": 0, "saturated": 0, "flushed": 0,
                                                "subnormal": 0, "nonfinite": 0, "errors": []})
            for key in ("numel", "nonzero", "saturated", "flushed", "subnormal", "nonfinite"):
                acc[key] += n[key]
            acc["errors"].append(n["rel_error"])
    row = {"recipe": recipe.name, "operands": sum(len(a["errors"]) for a in sums.values()),
           "nonfinite": int(sum(a["nonfinite"] for a in sums.values()))}
    for kind, a in sums.items():
        row[f"saturated_{kind}"] = 100.0 * a["saturated"] / a["numel"]
        row[f"flushed_{kind}"] = 100.0 * a["flushed"] / a["nonzero"] if a["nonzero"] else 0.0
        row[f"subnormal_{kind}"] = 100.0 * a["subnormal"] / a["numel"]
        row[f"rel_error_{kind}"] = sum(a["errors"]) / len(a["errors"])
    return row


def run_recipe(run_dir: Path) -> dict | None:
    """The recipe the run trained under, {name, **settings}, from its config.yaml (lab.record's and a study run's);
    None where it names none."""
    from lab.core.settings import spec_dict
    path = run_dir / "config.yaml"
    mode = (runfiles.read_yaml(path) if path.is_file() else {}).get("mode")
    return spec_dict(mode.get("recipe")) if isinstance(mode, dict) else None


def replay_run(run_dir: str | Path, recipes: list | None = None) -> list[dict]:
    """Each recipe (names or {name, settings}; default: the run's own recipe with its settings, marked "(this
    run)", which reproduces its census on these tensors, then every registered recipe at its defaults) replayed over
    the run's kept operands."""
    run_dir = Path(run_dir)
    path = run_dir / OPERANDS
    if not path.is_file():
        raise Fp8ReplayError(f"{run_dir}: no {OPERANDS} (not an FP8 run with a census, or recorded before the lab "
                             "kept its operands)")
    operands = runfiles.read_tensors(path)  # RunFileError naming the file when it is cut or damaged
    if not operands:
        raise Fp8ReplayError(f"{path}: no layer's operands were kept")
    step = next(iter(operands.values()))["step"]
    census = read_rows(run_dir, ("step", "layer", "gemm", "role", "amax")) or []
    histories = _histories(run_dir, step, census)
    gemms = {(r["layer"], r["gemm"]) for r in census if r["step"] == step} or None
    own = run_recipe(run_dir) if recipes is None else None
    if recipes is None:
        _load_recipe_files()
        recipes = ([own] if own else []) + sorted(RECIPES)
    rows = []
    for i, spec in enumerate(recipes):
        recipe = create_recipe(spec)
        label = _label(recipe.name, spec) + (" (this run)" if own and i == 0 else "")
        try:
            rows.append({**replay_recipe(recipe, operands, histories, gemms), "recipe": label})
        except ValueError as e:  # a block format the run's shapes do not hold whole blocks of
            rows.append({"recipe": label, "operands": 0, "nonfinite": 0, "skipped": str(e)})
    return rows


def _label(name: str, spec) -> str:
    """A row's name: the recipe's at its defaults (`mxfp8-rceil`); given settings, the registered name and them
    (`mxfp8 rounding=floor`)."""
    settings = "" if isinstance(spec, str) else " ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return f"{spec['name']} {settings}" if settings else name


def format_table(rows: list[dict]) -> str:
    """The replay's rows as an aligned text table (percent shares, relative errors)."""
    kinds = [k for k in KIND.values() if any(f"flushed_{k}" in r for r in rows)]
    head = ["recipe"] + [f"{m} {k[:4]}" for k in kinds for m in ("sat%", "flush%", "sub%", "err")] + ["nan"]
    body = [[r["recipe"]] + [_cell(r.get(f"{m}_{k}")) for k in kinds
                             for m in ("saturated", "flushed", "subnormal", "rel_error")] + [str(r["nonfinite"])]
            + ([f"(not replayed: {r['skipped']})"] if r.get("skipped") else []) for r in rows]
    head += [""] if any(r.get("skipped") for r in rows) else []
    body = [b + [""] * (len(head) - len(b)) for b in body]
    width = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, width)) for line in [head] + body)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}"

"""Calibration through the study's own commands: null studies shaped like the study config, as run directories.

lab/study/calibration.py checks the inference functions on arrays. This module checks the path a study takes: it
reads the study config for each family's modes and seeds and the data for its validation examples (360 images; the
LM's next tokens in their unequal documents), writes one run directory per (family, mode, seed) as a run writes it
(`metrics.json`, `outcomes.npz`), and runs `aggregate` (`lab aggregate`: summary.csv's verdicts), `claims.evaluate`
with the study's claims file, its declared margins and its sequential plans (`lab claims`), and `compare_modes`
(`lab compare`) on them. Under no true difference every decision that asserts a difference is false; the rates
are what tests/test_calibration.py and benchmarks/calibration/calibrate_verdicts.py hold to the declared levels.

Each run's quality is a seed effect shared by every mode of that seed, plus the run's own trajectory noise (a
`wide` multiple of it for the modes named, as the LM's fp16-noscale), plus an optional mode × example interaction;
an example is right when its difficulty plus all that plus example × run noise is positive; its loss is the
softplus of the same margin.
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lab.study import aggregate as agg, claims as claims_mod, compare as compare_mod, verdicts
from lab.study.claims.file import load_declared, load_sequential
from lab.study.runs_table import runs_table

__all__ = ["Shape", "study_shape", "null_study", "null_rates"]


@dataclass
class Shape:
    """One family as the study trains it: its modes (FP32 first), seeds and validation examples' units."""
    name: str
    modes: list
    seeds: list
    unit: np.ndarray             # one entry per validation example: its unit (image, or the LM's document)
    run_sd: float = 0.15
    example_sd: float = 0.6
    seed_sd: float = 0.5
    wide: dict = field(default_factory=dict)   # mode -> multiple of run_sd
    mode_example_sd: float = 0.0


def study_shape(study: dict, wide: float = 10.0, interaction: float = 0.0) -> list[Shape]:
    """The families of a study config (lab.core.config.load_study), their validation units from the data itself;
    ``wide``: the run-to-run spread of every family's fp16-noscale as a multiple of the others'."""
    from lab.core.config import resolve_run
    from lab.core.study import family_seeds
    shapes = []
    for family, spec in study["models"].items():
        modes = list(spec.get("modes") or study["modes"])
        modes = ["fp32"] + [m for m in modes if m != "fp32"]
        val = resolve_run(study, family, "fp32", 0).data.build().val
        if hasattr(val, "doc_starts"):   # the LM: one example per next token, its document the unit
            n = len(val) * val.context
            unit = np.searchsorted(np.asarray(val.doc_starts), np.arange(1, n + 1), side="right") - 1
            shapes.append(Shape(family, modes, family_seeds(study, family), unit, run_sd=0.003, example_sd=0.3,
                                wide={"fp16-noscale": wide} if "fp16-noscale" in modes else {},
                                mode_example_sd=interaction / 30))
        else:
            shapes.append(Shape(family, modes, family_seeds(study, family), np.arange(len(val)),
                                wide={"fp16-noscale": wide} if "fp16-noscale" in modes else {},
                                mode_example_sd=interaction))
    return shapes


def _write_family(root: Path, shape: Shape, rng, effect: dict | None = None) -> list[Path]:
    n = len(shape.unit)
    units = int(shape.unit.max()) + 1
    difficulty = rng.normal(2.0, 1.5, n)
    seed_effect = {s: rng.normal(0, shape.seed_sd) for s in shape.seeds}
    dirs = []
    from lab.run import outcomes
    for mode in shape.modes:
        sd = shape.run_sd * shape.wide.get(mode, 1.0)
        shift = 0.0
        if shape.mode_example_sd and mode != "fp32":
            per_unit = rng.normal(0, shape.mode_example_sd, units)
            shift = (per_unit - per_unit.mean())[shape.unit]
        for seed in shape.seeds:
            margin = (difficulty + seed_effect[seed] + rng.normal(0, sd) + shift + (effect or {}).get(mode, 0.0)
                      + rng.normal(0, shape.example_sd, n))
            correct, loss = margin > 0, np.logaddexp(0.0, -margin)
            d = root / shape.name / mode / f"seed{seed}"
            d.mkdir(parents=True)
            rec = outcomes.write(d, correct, loss, shape.unit, "document" if units < n else "image")
            metrics = {"model": shape.name, "mode": mode, "seed": seed, "status": "ok",
                       "precision": "fp32" if mode == "fp32" else "fp16", "scaler": "none" if mode == "fp32" else
                       "static", "final_top1": float(correct.mean()), "final_val_loss": float(loss.mean()),
                       "final_train_loss": 0.1, "steps": 100, "overflow_steps": 0, "skipped_steps": 0,
                       "update_ratio": 1.0, "diverged": False, "throughput_samples_per_s": 1.0,
                       "peak_memory_mb": 1.0, "activation_mb": 1.0, "final_scale": 1.0, "min_scale": 1.0,
                       "max_scale": 1.0, "device_name": "simulated", "fp16_path": "n/a", "outcomes": rec}
            (d / "metrics.json").write_text(json.dumps(metrics))
            dirs.append(d)
    return dirs


#: under no true difference, a claim verdict that is false for each predicate kind (bound: by its side, below)
FALSE_UNDER_NULL = {"cost": ("supported",), "compare": ("supported",), "equivalent": ("contradicted",)}


def null_study(shapes: list[Shape], study: dict, claims_file, rng, compare=("fp16-amax", "fp16-dynamic"),
               effect: dict | None = None) -> dict:
    """One study through aggregate, claims and compare (null unless ``effect`` {family: {mode: quality shift}}):
    its cells' p-values and verdicts, its false claim verdicts, its compare table's resolved rows and the summary."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = [d for s in shapes for d in _write_family(root / "runs", s, rng, (effect or {}).get(s.name))]
        table = agg.aggregate(dirs, root / "summary.csv", root / "summary.md", study.get("stats"),
                              load_declared(claims_file))
        runs = agg.load_runs(dirs)
        per_run = runs_table(runs)
        # per-run claims on a measurement the null runs do not simulate (the census's flushed shares) are left out
        claims = [c for c in claims_mod.load_claims(claims_file) if _simulated(c, per_run)]
        records = claims_mod.evaluate(claims, {"summary": table, "runs": per_run}, None, load_sequential(claims_file))
        cmp = compare_mod.compare_modes(runs, *compare, outcomes=verdicts.read_outcomes(dirs))
    cells = []
    for _, r in table.iterrows():
        if r["mode"] == "fp32":
            continue
        wide = any(r["mode"] in s.wide for s in shapes if s.name == r["model"])
        for m in verdicts.METRICS:
            p = r.get(f"{m}_p")
            if isinstance(p, float) and math.isfinite(p):
                cells.append({"model": r["model"], "mode": r["mode"], "metric": m, "p": p, "wide": wide,
                              "resolved": bool(r.get(f"{m}_resolved"))})
    false_claims = [rec["id"] for claim, rec in zip(claims, records)
                    if rec["verdict"] in _false_verdicts(claim)]
    return {"cells": cells, "false_claims": false_claims,
            "compare_resolved": int(cmp["resolved"].sum()) if len(cmp) else 0, "summary": table}


def _simulated(claim: dict, per_run) -> bool:
    """A claim the null study can decide: one on the summary, or a per-run one whose column the runs carry."""
    if claim.get("reads") != "runs":
        return True
    spec = claim[next(k for k in claim if k not in claims_mod.CLAIM_KEYS)]
    return not isinstance(spec, dict) or spec.get("column") in per_run.columns


def _false_verdicts(claim: dict) -> tuple:
    kind = next(k for k in claim if k not in claims_mod.CLAIM_KEYS)
    if kind == "bound":
        body = claim[kind]
        # "Δ at least x" with x <= 0 (a cost of at most |x|) is true under the null: contradicting it is false;
        # "Δ at most x" with x < 0 (a cost of at least |x|) is false under the null: supporting it is false
        if "at_least" in body:
            return ("contradicted",) if body["at_least"] <= 0 else ("supported",)
        return ("supported",) if body["at_most"] < 0 else ("contradicted",)
    if kind == "all":
        return ()   # a conjunction of the above: decided through its parts' own kinds
    return FALSE_UNDER_NULL.get(kind, ())


def null_rates(reps: int, study: dict, claims_file, seed: int = 0, wide: float = 10.0,
               interaction: float = 0.0) -> dict:
    """Over ``reps`` null studies: the share of cells with p <= 0.05 (ordinary and wide), of studies with a resolved
    cell in summary.csv, with a false claim verdict, and with a resolved compare row."""
    shapes = study_shape(study, wide, interaction)
    rng = np.random.default_rng(seed)
    ordinary, wides, tables, claims, compares = [], [], 0, 0, 0
    for _ in range(reps):
        out = null_study(shapes, study, claims_file, rng)
        for c in out["cells"]:
            (wides if c["wide"] else ordinary).append(c["p"] <= 0.05)
        tables += any(c["resolved"] for c in out["cells"])
        claims += bool(out["false_claims"])
        compares += out["compare_resolved"] > 0
    return {"cell_ordinary": float(np.mean(ordinary)), "cell_wide": float(np.mean(wides)),
            "table_any": tables / reps, "claims_any": claims / reps, "compare_any": compares / reps,
            "n_ordinary": len(ordinary), "n_wide": len(wides), "reps": reps}


def power_rate(reps: int, study: dict, claims_file, family: str, mode: str, shift: float, seed: int = 0) -> dict:
    """A true effect planted on one cell (a quality shift of ``mode`` in ``family``: its validation loss falls):
    the share of studies whose summary resolves that cell's validation loss, the mean Δ it produced, and the seeds
    the table itself said the declared effect needs (what the power promise is checked against)."""
    shapes = study_shape(study, wide=1.0)
    rng = np.random.default_rng(seed)
    hits, deltas, needed = 0, [], []
    for _ in range(reps):
        out = null_study(shapes, study, claims_file, rng, effect={family: {mode: shift}})
        row = out["summary"].set_index(["model", "mode"]).loc[(family, mode)]
        hits += bool(row["val_loss_resolved"])
        deltas.append(float(row["val_loss_delta"]))
        needed.append(str(row["val_loss_seeds_needed"]))
    return {"power": hits / reps, "mean_delta": float(np.mean(deltas)), "seeds_needed": needed, "reps": reps}

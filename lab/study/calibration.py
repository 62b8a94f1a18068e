"""Calibration of the verdict procedure (lab/study/inference.py) by simulation, with the study's own structure.

``study_families`` reads the study config (configs/default.yaml) and its data, as lab/study/calibration_runs.py
does: each family's modes and seeds, 360 validation images for the image families, and the LM's next tokens in
their real, unequal documents (the document is the LM's unit). Each run's quality is a seed effect shared by every
mode of that seed (same initialisation and data order) plus the run's own trajectory noise; each family's
fp16-noscale has a ``wide`` multiple of the others' trajectory spread (the LM's ~150x, as measured). An example is
right when its difficulty plus the run's quality plus the example x run noise is positive, so top-1 moves in whole
images and two seeds often tie; its loss is the softplus of the same margin. ``interaction`` adds a mode x example
shift shared by a mode's seeds.

``null_rates`` runs the procedure on studies with no true difference and reports the false-resolution rates;
``power`` plants an effect on one mode. tests/test_calibration.py checks them against the declared level; the
through-the-commands version (run directories, `lab aggregate`, `lab claims`, `lab compare`) is calibration_runs.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from lab.study import inference


@dataclass(frozen=True)
class Family:
    """One simulated family: its validation units (examples per unit), seeds, modes, the run-noise sd of an ordinary
    mode, how many times larger the wide mode's is (mode ``wild_mode``; default the last), and the example x run
    noise."""
    name: str
    units: int = 360
    per_unit: int = 1
    seeds: int = 2
    modes: int = 8
    run_sd: float = 0.15
    wild: float = 1.0
    example_sd: float = 0.6
    seed_sd: float = 0.5
    mode_example_sd: float = 0.0  # each mode's own shift of each example's margin, the same on every seed
    unit_sizes: tuple = ()        # examples per unit where units differ (the LM's documents): overrides the above
    wild_mode: int = -1

    def unit(self) -> np.ndarray:
        sizes = self.unit_sizes or (self.per_unit,) * self.units
        return np.repeat(np.arange(len(sizes)), sizes)

    def is_wild(self, m: int) -> bool:
        return self.wild != 1.0 and m == self.wild_mode % self.modes


@functools.lru_cache(maxsize=4)
def study_families(config: str | None = None, wide: float = 1.0, lm_wide: float = 150.0,
                   interaction: float = 0.0) -> tuple[Family, ...]:
    """The families of a study config (None: configs/default.yaml) with their real validation units; ``wide``: each
    image family's fp16-noscale spread as a multiple of the others' (``lm_wide``: the LM's); ``interaction``: the
    mode x example sd (images; the LM's is 1/30 of it, its losses being that much finer)."""
    from lab.core.config import load_study
    from lab.study.calibration_runs import study_shape
    families = []
    for shape in study_shape(load_study(config), wide=1.0):
        wild_mode = shape.modes.index("fp16-noscale") if "fp16-noscale" in shape.modes else -1
        if shape.name == "lm" or shape.unit.max() + 1 < len(shape.unit):   # examples grouped in documents
            families.append(Family(shape.name, seeds=len(shape.seeds), modes=len(shape.modes), run_sd=0.003,
                                   example_sd=0.01, wild=lm_wide if wild_mode >= 0 else 1.0,
                                   mode_example_sd=interaction / 30,
                                   unit_sizes=tuple(int(c) for c in np.bincount(shape.unit)), wild_mode=wild_mode))
        else:
            families.append(Family(shape.name, units=len(shape.unit), seeds=len(shape.seeds), modes=len(shape.modes),
                                   wild=wide if wild_mode >= 0 else 1.0, mode_example_sd=interaction,
                                   wild_mode=wild_mode))
    return tuple(families)


#: the interaction scenario's strength: each mode shifts each example's margin its own way on every seed (what a
#: rounding rule that favours some images does), so the test set's sample does not average out over seeds; the
#: examples' shared component must stay in the interval. 5 is strong enough that an interval without
#: that component claims a difference in about half the studies (60 simulated studies of the config's shape),
#: where the lab's interval claims none
INTERACTION_SD = 5.0
#: a family where two seeds tie often: one mode against FP32, runs that differ in a few images only
TIES = Family("ties", modes=2, run_sd=0.08, example_sd=0.0)


def simulate_family(fam: Family, rng, effect: dict | None = None) -> dict:
    """{metric: (values {mode: {seed: run value}}, per-example {mode: {seed: array}})} and the example units."""
    unit = fam.unit()
    n, units = len(unit), int(unit[-1]) + 1
    difficulty = rng.normal(2.0, 1.5, n)
    seed_effect = rng.normal(0, fam.seed_sd, fam.seeds)
    effect = effect or {}
    out = {"top1": ({}, {}), "val_loss": ({}, {})}
    for m in range(fam.modes):
        sd = fam.run_sd * (fam.wild if fam.is_wild(m) else 1.0)
        # a mode x example interaction (per unit, centred: no mean difference), shared by the mode's seeds
        shift = rng.normal(0, fam.mode_example_sd, units)[unit] if fam.mode_example_sd else 0.0
        shift = shift - np.mean(shift) if fam.mode_example_sd else 0.0
        for s in range(fam.seeds):
            quality = seed_effect[s] + rng.normal(0, sd) + effect.get(m, 0.0)
            margin = difficulty + quality + shift + rng.normal(0, fam.example_sd, n)
            correct = (margin > 0).astype(float)
            loss = np.logaddexp(0.0, -margin)
            for metric, x in (("top1", correct), ("val_loss", loss)):
                out[metric][0].setdefault(m, {})[s] = float(x.mean())
                out[metric][1].setdefault(m, {})[s] = x
    return {"metrics": out, "unit": unit}


def family_cells(sim: dict, metric: str, margin: float) -> dict:
    """inference.family_cells on one simulated family (mode 0 is the reference)."""
    values, examples = sim["metrics"][metric]
    units = {}
    for m in values:
        if m == 0:
            continue
        seeds = sorted(set(values[m]) & set(values[0]))
        per_ex = np.mean([examples[m][s] - examples[0][s] for s in seeds], axis=0)
        identical = all(np.array_equal(examples[m][s], examples[0][s]) for s in seeds)
        fixed = inference.fixed_example_variance([inference.unit_shares(examples[m][s] - examples[0][s], sim["unit"])
                                                  for s in seeds])
        units[m] = (inference.unit_shares(per_ex, sim["unit"]), identical, 0, fixed)
    return inference.family_cells(values, units, 0, margin)


MARGINS = {"top1": 0.01, "val_loss": 0.02}


def run_study(rng, families, effect: dict | None = None, alpha: float = 0.05) -> list[dict]:
    """One simulated study through the whole procedure: a row per cell with its verdict (BH over the table)."""
    cells, rows = [], []
    for fam in families:
        sim = simulate_family(fam, rng, (effect or {}).get(fam.name))
        for metric in ("top1", "val_loss"):
            for mode, cell in family_cells(sim, metric, MARGINS[metric]).items():
                cells.append(cell)
                rows.append({"family": fam.name, "metric": metric, "mode": mode, "wild": fam.is_wild(mode),
                             "spread": cell.spread, "p_diff": cell.p_diff, "delta": cell.delta,
                             "higher_is_better": metric == "top1"})
    decided = inference.decide_table(cells, alpha, [r["higher_is_better"] for r in rows])
    for r, (v, _, _) in zip(rows, decided):
        r["verdict"] = v
        r["resolved"] = v in ("cost", "gain", "negligible")
    return rows


def null_rates(reps: int, families, seed: int = 0, alpha: float = 0.05) -> dict:
    """False-resolution rates over ``reps`` null studies: per cell before multiplicity (ordinary and wild modes),
    and per study after it (any cell resolved: the family-wise rate, which BH controls under the complete null)."""
    rng = np.random.default_rng(seed)
    ordinary, wild, any_resolved = [], [], 0
    for _ in range(reps):
        rows = run_study(rng, families, alpha=alpha)
        for r in rows:
            if math.isfinite(r["p_diff"]):
                (wild if r["wild"] else ordinary).append(r["p_diff"] <= alpha)
        any_resolved += any(r["resolved"] for r in rows)
    return {"cell_ordinary": float(np.mean(ordinary)), "cell_wild": float(np.mean(wild)),
            "study_any": any_resolved / reps, "n_ordinary": len(ordinary), "n_wild": len(wild), "reps": reps}


def fixed_shift_rate(reps: int, seed: int = 0, alpha: float = 0.05, flips: int = 6) -> dict:
    """Modes that differ from FP32 by the same examples in every seed (a fixed set of images flipped, a fixed
    per-example change of loss, symmetric: no true difference over the population of examples), as a rule that
    always rounds the same borderline images would: every seed's Δ is the same, so the seed spread is zero (or
    rounding), pooled over all modes. Returns how many of those cells were decided and how many there were: the
    procedure decides none (a spread of zero says nothing about the next seed)."""
    rng = np.random.default_rng(seed)
    fam = Family("fixed")
    decided = cells = 0
    for _ in range(reps):
        sim = simulate_family(fam, rng)
        n = len(fam.unit())
        ref = np.array([sim["metrics"]["top1"][1][0][s] for s in range(fam.seeds)])
        right, wrong = np.flatnonzero(ref.min(0) == 1), np.flatnonzero(ref.max(0) == 0)
        for m in range(1, fam.modes):
            up = rng.binomial(flips, 0.5)  # images turned right; the rest turned wrong: symmetric
            to_right = rng.choice(wrong, min(up, len(wrong)), replace=False)
            to_wrong = rng.choice(right, min(flips - up, len(right)), replace=False)
            bump = rng.normal(0, 0.05, n)
            for s in range(fam.seeds):
                ref_c, ref_l = sim["metrics"]["top1"][1][0][s], sim["metrics"]["val_loss"][1][0][s]
                c = ref_c.copy()
                c[to_right], c[to_wrong] = 1.0, 0.0
                for metric, x in (("top1", c), ("val_loss", ref_l + bump)):
                    sim["metrics"][metric][0][m][s] = float(x.mean())
                    sim["metrics"][metric][1][m][s] = x
        for metric in ("top1", "val_loss"):
            for cell in family_cells(sim, metric, MARGINS[metric]).values():
                cells += 1
                decided += math.isfinite(cell.p_diff) and cell.p_diff <= alpha
    return {"cells": cells, "decided": decided}


def tie_rate(reps: int, seed: int = 0, alpha: float = 0.05) -> dict:
    """In the TIES family (one mode, two seeds, a few images apart) under the null: among the replicates whose two
    seeds' top-1 Δs are equal, how often the difference is resolved (unadjusted: one cell)."""
    rng = np.random.default_rng(seed)
    tied = resolved = 0
    for _ in range(reps):
        sim = simulate_family(TIES, rng)
        values = sim["metrics"]["top1"][0]
        d = [values[1][s] - values[0][s] for s in range(TIES.seeds)]
        if d[0] != d[1] or d[0] == 0:
            continue
        tied += 1
        cell = family_cells(sim, "top1", MARGINS["top1"])[1]
        resolved += math.isfinite(cell.p_diff) and cell.p_diff <= alpha
    return {"tied": tied, "resolved": resolved, "rate": resolved / tied if tied else math.nan}


def power(reps: int, effect: float, families, family: str = "lm", metric: str = "val_loss", seed: int = 0,
          alpha: float = 0.05, mode: int = 1) -> tuple[float, float]:
    """(share of studies in which a quality shift ``effect`` planted on mode 1 of ``family`` is resolved in
    ``metric`` after BH over the table, the mean Δ it produced)."""
    rng = np.random.default_rng(seed)
    hits, deltas = 0, []
    for _ in range(reps):
        rows = run_study(rng, families, effect={family: {mode: effect}}, alpha=alpha)
        [row] = [r for r in rows if r["family"] == family and r["mode"] == mode and r["metric"] == metric]
        hits += row["resolved"]
        deltas.append(row["delta"])
    return hits / reps, float(np.mean(deltas))

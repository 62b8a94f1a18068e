"""The summary's verdict columns: every (family, mode, metric) against FP32, decided as one table.

lab/study/inference.py holds the procedure (pooled seed spread, per-example variance, TOST, Benjamini–Hochberg);
this module feeds it the runs (metrics.json and outcomes.npz), the declared margins (configs/claims.yaml
`declared:`), and turns its cells into summary.csv columns.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.run import outcomes as run_outcomes
from lab.study import inference

REFERENCE_MODE = "fp32"
#: summary metric -> (metrics.json field, higher is better, outcomes.npz array)
METRICS = {"top1": ("final_top1", True, "correct"), "val_loss": ("final_val_loss", False, "loss")}
CELL_SUFFIXES = ("delta", "delta_ci", "ci90", "se", "df", "se_seed", "df_seed", "se_example", "se_example_fixed",
                 "spread", "units", "p", "q",
                 "p_tost", "q_tost", "resolved", "equivalent", "verdict", "margin", "effect", "seeds_needed",
                 "n_pairs", "note")


def uniform_loss(row: dict) -> float:
    """ln C: the validation loss of a uniform guess, what a diverged run's non-finite losses count as."""
    v = row.get("val_loss_uniform")
    if v is not None and np.isfinite(v):
        return float(v)
    c = row.get("num_classes")
    return math.log(c) if c is not None and np.isfinite(c) and c > 1 else math.nan


def _example_values(row: dict, outcome: dict, metric: str) -> np.ndarray:
    x = outcome[METRICS[metric][2]].astype(float)
    if metric == "val_loss":
        x = np.where(np.isfinite(x), x, uniform_loss(row))
    return x


def _run_value(row: dict, outcome: dict | None, metric: str) -> float:
    if outcome is not None:
        return float(_example_values(row, outcome, metric).mean())
    v = float(pd.to_numeric(row.get(METRICS[metric][0]), errors="coerce"))
    return uniform_loss(row) if metric == "val_loss" and not math.isfinite(v) else v


def family_inputs(rows: list[dict], outs: list, metric: str, reference: str):
    """(values {mode: {seed: run value}}, units {mode: (unit shares | None, identical, diverged runs)}) of one
    family, from its runs' metrics rows and outcomes (None where a run has none)."""
    values, examples, diverged = {}, {}, {}
    for row, out in zip(rows, outs):
        mode, seed = row["mode"], row["seed"]
        v = _run_value(row, out, metric)
        if not math.isfinite(v):
            continue
        values.setdefault(mode, {})[seed] = v
        examples.setdefault(mode, {})[seed] = (None if out is None else (_example_values(row, out, metric),
                                                                        out["unit"], out))
        diverged[mode] = diverged.get(mode, 0) + bool(row.get("diverged"))
    units = {}
    ref = examples.get(reference, {})
    for mode, by_seed in examples.items():
        if mode == reference:
            continue
        seeds = sorted(set(by_seed) & set(ref))
        pairs = [(by_seed[s], ref[s]) for s in seeds]
        usable = pairs and all(a is not None and b is not None and len(a[0]) == len(b[0]) for a, b in pairs)
        if not usable:
            units[mode] = (None, False, diverged.get(mode, 0))
            continue
        per_example = np.mean([a[0] - b[0] for a, b in pairs], axis=0)
        # the runs' outputs, not one metric's view of them: the same right/wrong vector with other losses is not
        # the same run (and a Δ of exactly 0 with no spread would decide claims on nothing)
        identical = all(_same_outputs(a[2], b[2]) for a, b in pairs)
        unit = pairs[0][1][1]
        fixed = inference.fixed_example_variance([inference.unit_shares(a[0] - b[0], unit) for a, b in pairs])
        units[mode] = (inference.unit_shares(per_example, unit), identical, diverged.get(mode, 0), fixed)
    return values, units


def _same_outputs(a: dict, b: dict) -> bool:
    """Bit for bit the same evaluation: every example's correctness and loss (NaN where both are NaN)."""
    return all(k in a and k in b and np.array_equal(np.asarray(a[k]), np.asarray(b[k]), equal_nan=k == "loss")
               for k in ("correct", "loss"))


def declared_for(declared: dict, model: str, metric: str, fallback: dict) -> tuple[float, float]:
    """(margin, effect of interest) declared for a family's metric in configs/claims.yaml; the study config's
    `stats.margins` where the family is not declared (effect = margin)."""
    d = (declared or {}).get(model, {}).get(metric)
    if d:
        return float(d["margin"]), float(d.get("effect", d["margin"]))
    m = float(fallback[metric])
    return m, m


def seeds_needed(cell: inference.Cell, var_delta: float, df_seed: float, effect: float, v_fixed: float,
                 alpha: float) -> str:
    """Paired seeds for 80% power against the declared effect at ``alpha`` (the table's sizing level)."""
    if not (cell.decidable and math.isfinite(effect)):
        return ""
    v_ex = cell.se_example ** 2 if math.isfinite(cell.se_example) else 0.0
    v_fixed = min(v_fixed, v_ex) if math.isfinite(v_fixed) else v_ex
    # the examples' part that more seeds would average away joins the per-seed variance; the part every seed shares
    # (the test set's own) stays
    per_seed = var_delta + (v_ex - v_fixed) * max(cell.n_pairs, 1)
    return inference.fmt_seeds(inference.seeds_range(effect, per_seed, df_seed, v_fixed, alpha, 0.8))


def _cell_columns(name: str, cell: inference.Cell, var_delta: float, df_seed: float, effect: float,
                  confidence: float, v_fixed: float = math.nan) -> dict:
    alpha = 1 - confidence
    hw = cell.half_width(confidence) if cell.decidable else math.nan
    v_ex = cell.se_example ** 2 if math.isfinite(cell.se_example) else 0.0
    v_fixed = min(v_fixed, v_ex) if math.isfinite(v_fixed) else v_ex
    seeds = ""  # sized once the table's tests are counted (verdict_columns)
    return {f"{name}_delta": cell.delta, f"{name}_delta_ci": hw,
            f"{name}_ci90": cell.half_width(1 - 2 * alpha) if cell.decidable else math.nan,
            f"{name}_se": cell.se, f"{name}_df": cell.df, f"{name}_se_seed": cell.se_seed, f"{name}_df_seed": df_seed,
            f"{name}_se_example": cell.se_example, f"{name}_se_example_fixed": math.sqrt(v_fixed),
            f"{name}_spread": cell.spread, f"{name}_units": cell.n_units,
            f"{name}_p": cell.p_diff, f"{name}_p_tost": cell.p_tost, f"{name}_margin": cell.margin,
            f"{name}_effect": effect, f"{name}_seeds_needed": seeds, f"{name}_n_pairs": cell.n_pairs,
            f"{name}_note": cell.note}


def verdict_columns(runs: pd.DataFrame, outs: list, declared: dict, fallback: dict,
                    confidence: float) -> pd.DataFrame:
    """One row per (model, mode) with every metric's cell columns, verdicts decided over the whole table
    (Benjamini–Hochberg at 1 − confidence across its difference tests, and across its equivalence tests)."""
    records = runs.to_dict("records")
    rows, cells, hib, sizing = {}, [], [], []
    for model in dict.fromkeys(runs["model"]):
        idx = [i for i, r in enumerate(records) if r["model"] == model]
        fam_rows, fam_outs = [records[i] for i in idx], [outs[i] for i in idx]
        for name, (_, higher, _) in METRICS.items():
            values, units = family_inputs(fam_rows, fam_outs, name, REFERENCE_MODE)
            margin, effect = declared_for(declared, model, name, fallback)
            if REFERENCE_MODE not in values:
                continue
            for mode, cell in inference.family_cells(values, units, REFERENCE_MODE, margin).items():
                v, df = cell.extra.get("var_delta", math.nan), cell.extra.get("df_seed", math.nan)
                row = rows.setdefault((model, mode), {"model": model, "mode": mode})
                fixed = units.get(mode, (None, False, 0, math.nan))[3] if len(units.get(mode, ())) > 3 else math.nan
                row.update(_cell_columns(name, cell, v, df, effect, confidence, fixed))
                cells.append((model, mode, name, cell))
                sizing.append((row, name, cell, v, df, effect, fixed))
                hib.append(higher)
    # sized at the level the verdict needs: BH's first step over the table's difference tests
    tests = sum(math.isfinite(c[3].p_diff) for c in cells)
    alpha_size = inference.sizing_alpha(1 - confidence, tests)
    for row, name, cell, v, df, effect, fixed in sizing:
        row[f"{name}_seeds_needed"] = seeds_needed(cell, v, df, effect, fixed, alpha_size)
    decided = inference.decide_table([c[3] for c in cells], 1 - confidence, hib)
    for (model, mode, name, _), (verdict, q, q_tost) in zip(cells, decided):
        rows[(model, mode)].update({f"{name}_q": q, f"{name}_q_tost": q_tost, f"{name}_verdict": verdict,
                                    f"{name}_resolved": verdict in ("cost", "gain", "negligible"),
                                    f"{name}_equivalent": verdict in ("equivalent", "negligible", "identical")})
    return pd.DataFrame(list(rows.values()), columns=None if rows else ["model", "mode"])


def read_outcomes(run_dirs) -> list:
    """Each run's outcomes.npz (None for a run that has none)."""
    return [run_outcomes.read(d) for d in run_dirs]


def error_rate_line(table: pd.DataFrame, confidence: float) -> str:
    """What the table controls, in one sentence."""
    tests = int(sum(table[f"{m}_p"].notna().sum() for m in METRICS if f"{m}_p" in table))
    return (f"Error rate: false discovery rate {1 - confidence:.0%} (Benjamini–Hochberg) across this table's {tests} "
            "difference tests, and separately across its equivalence tests (TOST at the declared margins).")

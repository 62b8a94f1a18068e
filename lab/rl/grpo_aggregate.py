"""The RL study's GRPO runs as one table (``python -m lab rl-aggregate``): per mode, over its seeds, the share of
held-out problems solved at the end and its difference from fp32 on the same seed (mean and 95% Student-t interval
over the seeds: each seed's whole run is the independent unit), skipped and overflow steps, the final scale, and the
sampler/learner mismatch. Descriptive: the verdicts against declared margins are the claims file's (docs/rl.md).
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.core import files
from lab.rl.grpo_study import mode_seeds, mode_train, rl_runs, run_folder, sampler_name
from lab.rl.tables import delta_cell, mean_of, pct, read_metrics
from lab.study.stats import t_interval

__all__ = ["aggregate", "COLUMNS", "RUN_COLUMNS"]

#: runs.csv: one row per run, what the claims test, seed by seed (lab/study/claims/runs.py's kinds)
RUN_COLUMNS = ["mode", "seed", "steps", "divisor", "solved_start", "solved_end", "train_reward_last10",
               "skipped_steps", "overflow_steps", "final_scale", "mismatch_abs_mean", "mismatch_k3",
               "mismatch_out_of_band", "mismatch_clipped", "mismatch_low_prob", "mismatch_high_prob"]
COLUMNS = ["mode", "reference", "steps", "divisor", "sampler", "learner", "policy", "loss", "seeds", "solved_start",
           "solved_end", "delta_vs_fp32", "delta_half_width", "skipped_steps", "overflow_steps", "final_scale", "mismatch_abs_mean", "mismatch_k3",
           "out_of_band", "clipped"]


def aggregate(study: dict, csv_path: Path, md_path: Path, runs_path: Path | None = None) -> list[dict]:
    runs = {(mode, seed): read_metrics(run_folder(study, mode, seed) / "metrics.json", "solved_end", "an RL run")
            for mode, seed in rl_runs(study)}  # all read before writing
    rows = []
    for name, mode in study["modes"].items():
        mine = {seed: runs[(name, seed)] for seed in mode_seeds(study, name)}
        ref = mode.reference if mode.reference in study["modes"] and mode.reference != name else None
        common = [s for s in mine if ref and (ref, s) in runs]  # paired on the seeds both modes ran
        diffs = [mine[s]["solved_end"] - runs[(ref, s)]["solved_end"] for s in common]
        mean, half = t_interval(diffs) if diffs else (math.nan, math.nan)
        train = mode_train(study, name)
        rows.append({"mode": name, "reference": ref or "", "steps": train["steps"], "divisor": train["divisor"],
                     "sampler": sampler_name(mode.sampler), "learner": mode.learner,
                     "policy": mode.scaler["policy"] if mode.scaler else "none", "loss": mode.loss_kind,
                     "seeds": len(mine), "solved_start": mean_of(m["solved_start"] for m in mine.values()),
                     "solved_end": mean_of(m["solved_end"] for m in mine.values()),
                     "delta_vs_fp32": mean, "delta_half_width": half,
                     "skipped_steps": mean_of(m["skipped_steps"] for m in mine.values()),
                     "overflow_steps": mean_of(m["overflow_steps"] for m in mine.values()),
                     "final_scale": mean_of(m["final_scale"] for m in mine.values()),
                     **{k: mean_of(m[f"mismatch_{src}"] for m in mine.values())
                        for k, src in (("mismatch_abs_mean", "abs_mean"), ("mismatch_k3", "k3"),
                                       ("out_of_band", "out_of_band"), ("clipped", "clipped"))}})
    files.atomic_write_csv(csv_path, rows, COLUMNS)
    files.atomic_write_text(md_path, _markdown(rows, study))
    if runs_path is not None:
        files.atomic_write_csv(runs_path, [{"mode": m, "seed": s, **{k: metrics.get(k) for k in RUN_COLUMNS[2:]},
                                            "steps": mode_train(study, m)["steps"]}
                                           for (m, s), metrics in runs.items()], RUN_COLUMNS)
    return rows


def _markdown(rows: list[dict], study: dict) -> str:
    lines = ["| mode | steps, divisor | sampler / learner | scaler | solved (start → end) | Δ vs its reference "
             "(same seed) | skipped | mean abs(log pi - log mu) | k3 | out of PPO's band |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = f" (vs {r['reference']})" if r["reference"] and r["reference"] != "fp32" else ""
        lines.append(f"| {r['mode']} | {r['steps']}, {r['divisor']:g} | {r['sampler']} / {r['learner']} | "
                     f"{r['policy']} | {pct(r['solved_start'])} → {pct(r['solved_end'])} | {delta_cell(r)}{ref} | "
                     f"{r['skipped_steps']:.1f} | {r['mismatch_abs_mean']:.2g} | {r['mismatch_k3']:.2g} | "
                     f"{pct(r['out_of_band'])} |")
    t = study["train"]
    lines += ["", f"Seeds per mode: {', '.join(sorted({str(r['seeds']) for r in rows}))}; GRPO steps of "
              f"{t['prompts']} problems x {t['group']} samples, each backward's loss / divisor (divisor D > 1: FP16's "
              "magnitudes of one micro-batch of a D-way accumulated step; D < 1: a backward 1/D times the step's, "
              "gradients multiplied back in FP32 after unscale_); solved: the share of 512 held-out problems, "
              "sampled in FP32. Δ: mean over seeds of the paired difference, ± the half width of its 95% Student-t interval (seeds as the unit; no "
              "multiplicity correction: descriptive, the claims file decides). Generated by `python -m lab "
              "rl-aggregate`."]
    return "\n".join(lines) + "\n"

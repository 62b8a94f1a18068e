"""Synthetic results for the figure, report and notebook tests: run directories shaped like real ones.

`make_results(root)` writes root/runs/<model>/<mode>/seed<n>/ with metrics.json, steps.csv, config.yaml and,
unless census=False, census.csv and grad_hist.csv in the formats the gradient census writes (FP32 runs:
counterfactual rows at scales 1, 128, 1024, 65536; FP16 runs: the scale in use).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import yaml

MODES = {"fp32": ("fp32", None), "fp16-static128": ("fp16", 128.0), "fp16-dynamic": ("fp16", 65536.0)}
LAYERS = ["conv_stem", "stages.0.conv", "stages.1.conv", "head.fc"]
SOURCES = ["activation_grad", "param_grad"]
N_STEPS = 40
CENSUS_STEPS = [0, 10, 20, 30]
FP16_UNDERFLOW_LOG2, FP16_OVERFLOW = -25, 65520.0


def _write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def _log2_magnitudes(rng, layer_i, source, n=4000):
    """Gradient magnitudes (log2) of a layer: early layers smaller, as in deep nets."""
    centre = -19.0 - 2.5 * (len(LAYERS) - 1 - layer_i) + (2.0 if source == "param_grad" else 0.0)
    return rng.normal(centre, 3.0, n)


def _classify(log2x, scale):
    """Counts as lab.numerics.census classifies |x| * scale (x != 0, round to nearest even): underflow <= 2^-25,
    subnormal < 2^-14 - 2^-25, overflow >= 65520."""
    y = log2x + math.log2(scale)
    under = int((y <= FP16_UNDERFLOW_LOG2).sum())
    over = int((y >= math.log2(FP16_OVERFLOW)).sum())
    sub = int(((y > FP16_UNDERFLOW_LOG2) & (y < math.log2(2.0 ** -14 - 2.0 ** -25))).sum())
    return under, sub, len(y) - under - over - sub, over


def make_run(run_dir: Path, model: str, mode: str, seed: int, census: bool = True) -> Path:
    precision, scale0 = MODES[mode]
    rng = np.random.default_rng(seed * 100 + len(mode))
    run_dir.mkdir(parents=True, exist_ok=True)
    steps, scale, skipped_total, overflow = [], scale0 or 1.0, 0, 0
    for step in range(N_STEPS):
        found_inf = mode == "fp16-dynamic" and (step < 3 or step == 25)
        used = scale
        if mode == "fp16-dynamic":
            scale = scale / 2 if found_inf else (scale * 2 if step % 10 == 9 else scale)
        skipped_total += found_inf
        overflow += found_inf
        steps.append(dict(step=step, epoch=step // 20, loss=2.3 * math.exp(-step / 15) + 0.05 * rng.random(),
                          scale=used, found_inf=int(found_inf), skipped=int(found_inf),
                          grad_norm=float("inf") if found_inf else 1.0 + rng.random(), lr=1e-3, precision=precision))
    _write_csv(run_dir / "steps.csv", steps, list(steps[0]))
    top1 = {"fp32": 0.95, "fp16-static128": 0.94, "fp16-dynamic": 0.945}[mode] + 0.01 * seed
    metrics = dict(model=model, preset="synthetic", mode=mode, seed=seed, device="cpu", device_name="synthetic CPU",
                   precision=precision, scaler={"fp32": "none", "fp16-static128": "static",
                                                "fp16-dynamic": "dynamic"}[mode],
                   threads=1, status="ok", fp16_path="n/a" if precision == "fp32" else "cpu-tensor-core-contract",
                   steps=N_STEPS, epochs=2, final_top1=top1, best_top1=top1, final_train_loss=steps[-1]["loss"],
                   overflow_steps=overflow, skipped_steps=skipped_total,
                   update_ratio=(N_STEPS - skipped_total) / N_STEPS, final_scale=scale,
                   min_scale=min(r["scale"] for r in steps), max_scale=max(r["scale"] for r in steps),
                   diverged=False, throughput_samples_per_s=1000.0 if precision == "fp32" else 800.0,
                   peak_memory_mb=1000.0, activation_mb=10.0 if precision == "fp32" else 5.0, wall_s=1.0)
    config = {"model": {"family": model, "preset": "synthetic"},
              "mode": {"name": mode, "precision": precision,
                       **({"scaler": {"policy": metrics["scaler"]}} if precision == "fp16" else {})},
              "seed": seed}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    if census:
        crow, hrow = [], []
        for step in CENSUS_STEPS:
            used = steps[step]["scale"]
            scales = [1.0, 128.0, 1024.0, 65536.0] if precision == "fp32" else [used]
            for source in SOURCES:
                per_scale_total = {s: [0, 0, 0, 0, 0, 0] for s in scales}
                all_log2 = []
                for li, layer in enumerate(LAYERS):
                    x = _log2_magnitudes(rng, li, source)
                    zeros = int(0.3 * len(x)) if source == "activation_grad" else 0
                    all_log2.append(x)
                    for s in scales:
                        u, sub, nrm, o = _classify(x, s)
                        row = [len(x) + zeros, zeros, u, sub, nrm, o]
                        per_scale_total[s] = [a + b for a, b in zip(per_scale_total[s], row)]
                        crow.append(dict(step=step, scale=used, source=source, layer=layer, at_scale=s,
                                         total=row[0], zero=row[1], underflow=u, subnormal=sub, normal=nrm,
                                         overflow=o))
                for s in scales:
                    t = per_scale_total[s]
                    crow.append(dict(step=step, scale=used, source=source, layer="__total__", at_scale=s,
                                     total=t[0], zero=t[1], underflow=t[2], subnormal=t[3], normal=t[4],
                                     overflow=t[5]))
                hist_scale = 1.0 if precision == "fp32" else used
                k = np.floor(np.concatenate(all_log2) + math.log2(hist_scale)).astype(int)
                for b, n in zip(*np.unique(k, return_counts=True)):
                    hrow.append(dict(step=step, source=source, at_scale=hist_scale, log2_bin=int(b), count=int(n)))
                zeros = int(0.3 * 4000) * len(LAYERS) if source == "activation_grad" else 0
                hrow.append(dict(step=step, source=source, at_scale=hist_scale, log2_bin="zero", count=zeros))
                hrow.append(dict(step=step, source=source, at_scale=hist_scale, log2_bin="nonfinite", count=0))
        _write_csv(run_dir / "census.csv", crow, list(crow[0]))
        _write_csv(run_dir / "grad_hist.csv", hrow, list(hrow[0]))
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return run_dir


def make_results(root: Path, models=("resnet50",), modes=tuple(MODES), seeds=(0, 1), census=True) -> Path:
    """A results folder (root/runs/...) of synthetic runs; returns root."""
    for model in models:
        for mode in modes:
            for seed in seeds:
                make_run(Path(root) / "runs" / model / mode / f"seed{seed}", model, mode, seed, census=census)
    return Path(root)


RECIPE_MODES = {"bf16": None, "fp8-current": (0.0, 0.01, 0.0, 0.001, 0.0, 0.05),
                "fp8-noscale": (0.0, 0.4, 0.0, 4.0, 0.0, 97.0)}  # saturated / flushed % per kind: act, weight, grad


def make_recipe_runs(root: Path, model: str = "lm", seeds=(0, 1, 2)) -> Path:
    """Synthetic runs of a recipe study (configs/fp8.yaml's metrics: final_val_loss, recipe, the saturated and
    flushed shares per tensor kind) beside whatever root/runs holds; returns root."""
    for mode, shares in RECIPE_MODES.items():
        for seed in seeds:
            rng = np.random.default_rng(seed * 7 + len(mode))
            run_dir = Path(root) / "runs" / model / mode / f"seed{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            loss = 3.0 + 0.02 * seed + (0.01 if mode == "fp8-current" else 0.9 if mode == "fp8-noscale" else 0.0)
            steps = [dict(step=s, epoch=0, loss=6.9 * math.exp(-s / 10) + loss + 0.01 * rng.random(), scale=1.0,
                          found_inf=0, skipped=0, grad_norm=1.0, lr=1e-3, precision="bf16") for s in range(N_STEPS)]
            _write_csv(run_dir / "steps.csv", steps, list(steps[0]))
            metrics = dict(model=model, preset="synthetic", mode=mode, seed=seed, device="cpu", precision="bf16",
                           scaler="none", status="ok", steps=N_STEPS, final_top1=0.4, final_val_loss=loss,
                           num_classes=1024, train_time_s=10.0 * (1 if shares is None else 2), diverged=False)
            if shares is not None:
                metrics["recipe"] = mode
                for (what, kind), v in zip([(w, k) for w in ("saturated", "flushed")
                                            for k in ("activation", "weight", "gradient")], shares):
                    metrics[f"{what}_{kind}_pct"] = v
            (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"family": model}, "mode": {"name": mode},
                                                                 "seed": seed}))
            (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return Path(root)


def make_controller_tables(root: Path) -> Path:
    """Synthetic `lab judge-controllers` tables (controllers_fp16.csv, controllers_fp8.csv) in root/tables, as the
    controllers study writes them; returns root."""
    import pandas as pd
    from lab.scaling.learning.tables import FP16_COLUMNS
    tables = Path(root) / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    rows = [dict(family=f, policy=p, kind=k, runs=2, skipped_per_run=s, overflow_per_run=s, uncertain_steps=0,
                 flushed_activation=fl, flushed_param=fl / 2, front=fr)
            for f in ("lm", "vit") for p, k, s, fl, fr in (("dynamic", "hand-written", 3.0, 1e-5, False),
                                                          ("amax-history", "hand-written", 0.0, 4e-4, True),
                                                          ("amax-predicted:learned", "learned", 0.0, 2e-4, True))]
    pd.DataFrame(rows, columns=list(FP16_COLUMNS)).to_csv(tables / "controllers_fp16.csv", index=False)
    fp8 = [dict(family="lm", predictor=p, history_len=n, margin=0, role=r, tensors=8, steps=300,
                clipped_pct=c, unused_binades=u, exceeded_pct=c)
           for p, c, u in (("max", 4.0, 1.7), ("learned:model=x", 1.0, 1.6)) for n in (16, 1024)
           for r in ("grad_output", "all")]
    pd.DataFrame(fp8).to_csv(tables / "controllers_fp8.csv", index=False)
    return Path(root)

"""GPU-hours of a study from its budget file: per run, in all, and the node-day it needs.

    python benchmarks/calibration/recipe_budget.py                                   # configs/budgets/imagenet-1day.yaml
    python benchmarks/calibration/recipe_budget.py --throughput results/reference/nvidia-h200/throughput.json

The budget file (configs/budgets/*.yaml) holds the arithmetic's inputs (per-GPU throughput with its
sources, the data loader's ceiling, ImageNet's size, the node) and the hours it gives; this script
enumerates the study's runs with the lab's own config resolution (lab.core.config), computes each run's GPU-hours,
packs the runs longest first onto the node's GPUs and prints the table. `--throughput` replaces the
published per-GPU figures by those bench_throughput.py measured (fp32, and fp16 with GradScaler / bf16 for
the reduced-precision modes) for the families it measured. tests/test_recipe.py checks that the budget
file's hours are what this computes and that the config's comments quote them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core.config import load_study, resolve_run  # noqa: E402
from lab.core.study import study_runs

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET = REPO / "configs" / "budgets" / "imagenet-1day.yaml"


def load_budget(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def load_study_anywhere(config: str | Path) -> dict:
    """The study, validated by lab.core.config, with its local data paths pointed at a folder that exists (the
    arithmetic needs the runs, not the data)."""
    study = yaml.safe_load(Path(config).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        local = {"data": {"path": tmp}}
        lm_like = {m: {"data": {"path": tmp}} for m, e in study["models"].items() if "data" in e}
        if lm_like:
            local["models"] = lm_like
        override = Path(tmp) / "local.yaml"
        override.write_text(yaml.safe_dump(local))
        return load_study([config, override])


def fp32_rate(budget: dict, preset: str) -> float:
    """A100 FP32 (TF32 off) samples/s derived from NVIDIA's V100 FP32 ResNet-50 figure (see the budget file)."""
    d, flops = budget["fp32_derivation"], budget["flops"]
    share = d["v100_resnet50_fp32_img_s"] * 3 * flops["resnet50"] / (d["v100_fp32_tflops"] * 1e12)
    return share * d["a100_fp32_tflops"] * 1e12 / (3 * flops[preset])


def rates(budget: dict, measured: dict | None = None) -> dict:
    """{preset: {"fp32": samples/s, "fp16": ..., "bf16": ...}} from the budget file, measured ones over them."""
    out = {}
    for preset, t in budget["throughput"].items():
        fp32 = fp32_rate(budget, preset) if t["fp32"] == "derived" else float(t["fp32"])
        out[preset] = {"fp32": fp32, "fp16": float(t["amp"]), "bf16": float(t["amp"])}
        out[preset].update((measured or {}).get(preset, {}))
    return out


def measured_rates(path: str | Path) -> dict:
    """bench_throughput.py's report -> {preset: {precision: samples/s}} (fp16: the GradScaler row)."""
    report = json.loads(Path(path).read_text())
    out: dict = {}
    for r in report["rows"]:
        if r["status"] != "ok" or r["precision"] == "tf32":
            continue
        if r["precision"] == "fp16" and r["scaler"] != "torch.amp.GradScaler":
            continue
        out.setdefault(r["preset"], {})[r["precision"]] = r["samples_per_s"]
    return out


def run_hours(cfg, budget: dict, rate: dict) -> tuple[float, float, str]:
    """(GPU-hours, samples/s used, what bounds it) of one resolved run."""
    preset, precision = cfg.model.preset, cfg.mode.precision
    per_s, bound = rate[preset][precision], "gpu"
    if cfg.data.name == "imagenet":
        loader = budget["loader"]["workers"] * budget["loader"]["images_per_s_per_worker"]
        if loader < per_s:
            per_s, bound = loader, "loader"
        trained = cfg.train.epochs * budget["imagenet"]["train_images"]
        evaluated = cfg.train.epochs * budget["imagenet"]["val_images"]
    else:  # a language model: tokens
        tokens_per_step = cfg.train.batch_size * cfg.train.accum_steps * cfg.data.context
        corpus = budget["lm_corpus_tokens"]
        steps = (corpus * (1 - cfg.data.val_fraction)) // tokens_per_step * cfg.train.epochs
        if cfg.train.max_steps:
            steps = min(steps, cfg.train.max_steps)
        trained = steps * tokens_per_step
        evaluated = cfg.data.val_fraction * corpus
    return (trained + budget["eval_cost"] * evaluated) / per_s / 3600, per_s, bound


def pack(hours: list[float], gpus: int) -> float:
    """Makespan of the runs placed longest first, each on the least loaded GPU."""
    load = [0.0] * gpus
    for h in sorted(hours, reverse=True):
        load[load.index(min(load))] += h
    return max(load)


def plan(budget_path: str | Path = DEFAULT_BUDGET, measured: dict | None = None) -> dict:
    budget = load_budget(budget_path)
    study = load_study_anywhere(REPO / budget["config"])
    rate = rates(budget, measured)
    runs = []
    for model, mode, seed in study_runs(study):
        cfg = resolve_run(study, model, mode, seed)
        hours, per_s, bound = run_hours(cfg, budget, rate)
        runs.append({"model": model, "preset": cfg.model.preset, "mode": mode, "precision": cfg.mode.precision,
                     "seed": seed, "hours": hours, "samples_per_s": per_s, "bound": bound})
    node = budget["node"]
    total = sum(r["hours"] for r in runs)
    makespan = pack([r["hours"] for r in runs], node["gpus"])
    per_preset: dict = {}
    for r in runs:
        cls = "fp32" if r["precision"] == "fp32" else "amp"
        per_preset.setdefault(r["preset"], {}).setdefault(cls, set()).add(round(r["hours"], 2))
    return {"budget": budget, "runs": runs, "total_gpu_hours": total, "makespan_hours": makespan,
            "node_gpu_hours": node["gpus"] * node["hours"], "day_hours": node["hours"],
            "limit_hours": (1 - budget["headroom"]) * node["hours"], "per_preset": per_preset}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default=str(DEFAULT_BUDGET))
    ap.add_argument("--throughput", default=None, help="a bench_throughput.py JSON report to use instead of the "
                    "published figures")
    args = ap.parse_args(argv)
    p = plan(args.budget, measured_rates(args.throughput) if args.throughput else None)
    groups: dict = {}
    for r in p["runs"]:
        key = (r["model"], r["preset"], "fp32" if r["precision"] == "fp32" else r["precision"])
        groups.setdefault(key, []).append(r)
    print(f"{'model':12s} {'preset':18s} {'precision':9s} {'samples/s':>10s} {'bound':>6s} {'h/run':>7s} "
          f"{'runs':>5s} {'GPU-h':>7s}")
    for (model, preset, precision), rs in groups.items():
        h = rs[0]["hours"]
        print(f"{model:12s} {preset:18s} {precision:9s} {rs[0]['samples_per_s']:10.0f} {rs[0]['bound']:>6s} "
              f"{h:7.2f} {len(rs):5d} {sum(r['hours'] for r in rs):7.1f}")
    print(f"total {p['total_gpu_hours']:.1f} GPU-h of {p['node_gpu_hours']:.0f} "
          f"({100 * p['total_gpu_hours'] / p['node_gpu_hours']:.0f}%); runs packed longest first on "
          f"{p['budget']['node']['gpus']} GPUs end after {p['makespan_hours']:.1f} h "
          f"(limit {p['limit_hours']:.1f} h = {1 - p['budget']['headroom']:.0%} of {p['day_hours']} h)")
    return p


if __name__ == "__main__":
    main()

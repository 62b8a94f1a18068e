"""Where a study's runs are and how its families relate: pure functions of a validated study (lab.core.config).

Which seeds and modes a family trains, the training jobs the workflow makes of them, the folder of each run, and
the run another family starts from (a fine-tune's base, a vision-language model's encoder)."""
from __future__ import annotations

import copy
from pathlib import Path


def deep_merge(base: dict, override: dict) -> dict:
    """Snakemake's rule for several --configfile: nested dicts merge, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def base_of(study: dict, model: str) -> tuple[str, str] | None:
    """(family, mode) of the study run a fine-tuning family starts from, or None (none, or a local HF folder)."""
    ft = study["models"][model].get("finetune")
    return None if ft is None or "base" not in ft else (ft["base"]["family"], ft["base"].get("mode", "fp32"))


def base_run_of(study: dict, model: str) -> tuple[str, str, int] | None:
    """(family, mode, seed) of a fine-tuning family's base run, or None."""
    ft = study["models"][model].get("finetune")
    return None if base_of(study, model) is None else (*base_of(study, model), ft["base"].get("seed", 0))


def run_folder(study: dict, model: str, mode: str, seed: int) -> Path:
    """Where the study writes one run: RESULTS/runs/<model>/<mode>/seed<seed>."""
    return Path(study["results_dir"]) / "runs" / model / mode / f"seed{seed}"


def encoder_run_of(study: dict, model: str) -> tuple[str, str, int] | tuple[()]:
    """(family, mode, seed) of the run a vision-language family takes its pre-trained encoder from, or ()."""
    enc = study["models"][model].get("encoder")
    return () if enc is None else (enc["family"], enc.get("mode", "fp32"), enc.get("seed", 0))


def encoder_settings(study: dict, model: str) -> dict | None:
    """ModelConfig.encoder of a family: where its encoder's run folder is, and which run it is."""
    if not encoder_run_of(study, model):
        return None
    family, mode, seed = encoder_run_of(study, model)
    return {"run": str(run_folder(study, family, mode, seed) / "weights.pt"),
            "family": family, "mode": mode, "seed": seed}


def base_model_folder(study: dict, model: str) -> str | None:
    """The local Hugging Face folder a fine-tuning family starts from (finetune.base_model), or None."""
    ft = study["models"][model].get("finetune") or {}
    return ft.get("base_model")


def finetune_settings(study: dict, model: str) -> dict | None:
    """ModelConfig.finetune of a family: its adapters and where its base run's folder (or HF folder) is."""
    ft = study["models"][model].get("finetune")
    if ft is None:
        return None
    if "base_model" in ft:
        where = {"base_model": str(Path(ft["base_model"]).expanduser())}
    else:
        family, mode, seed = base_run_of(study, model)
        where = {"base_run": str(run_folder(study, family, mode, seed)),
                 "base": {"family": family, "mode": mode, "seed": seed}}
    return {**where, "rank": ft.get("rank", 8),
            "alpha": ft.get("alpha", 16), "targets": list(ft.get("targets", ["qkv", "proj", "fc"])),
            "dropout": ft.get("dropout", 0.0),
            **({"adapter_dtype": ft["adapter_dtype"]} if "adapter_dtype" in ft else {}),
            **({"base_quant": ft["base_quant"]} if ft.get("base_quant", "none") != "none" else {})}


def family_seeds(study: dict, model: str) -> list[int]:
    """A family's seeds: its own `seeds` when it has them (a noisier family needs more), else the study's."""
    return study["models"][model].get("seeds", study["seeds"])


def family_modes(study: dict, model: str) -> list[str]:
    """A family's modes: its own `modes` (a subset, in the study's order) when it has them, else all the study's."""
    own = study["models"][model].get("modes")
    return [m for m in study["modes"] if own is None or m in own]


def study_runs(study: dict) -> list[tuple[str, str, int]]:
    return [(m, mode, s) for m in study["models"] for mode in family_modes(study, m) for s in family_seeds(study, m)]


def train_jobs(study: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The workflow's training jobs: each (model, mode)'s seeds in chunks of `seeds_per_job`, in seed order.
    A torchrun job (processes_per_run > 1) trains one run: its processes are the run's, not a job's."""
    k = study["seeds_per_job"] if study["processes_per_run"] == 1 else 1
    return [(m, mode, tuple(seeds[i:i + k])) for m in study["models"] for mode in family_modes(study, m)
            for seeds in [family_seeds(study, m)] for i in range(0, len(seeds), k)]


def seeds_label(seeds) -> str:
    """A job's seeds in its file names: 0, or 0-1-2 (each seed named, so that any seed list is exact)."""
    return "-".join(str(s) for s in seeds)

"""The RL study's config (configs/rl.yaml): the file read and validated as a whole, its two families parsed by their
own modules: GRPO's seeds, base, train and modes (lab/rl/grpo_study.py) and the DPO family's ``dpo:`` block
(lab/rl/dpo_study.py).

    study: rl                       # marks the file as the RL study's (make study, lab validate)
    results_dir: results/rl
    device: cpu                     # the only one: lab/rl/grpo_run.py trains on the CPU under the tensor-core contract
    seeds: [0, 1, 2]                # GRPO's (lab/rl/grpo_study.py)
    base: {steps: 400, seed: 0}
    train: {steps: 60, divisor: 4096, prompts: 16, group: 8, lr: 3.0e-4, census_every: 10}
    modes: {name: {sampler, learner, scaler, loss, fuse, train, seeds, reference}}
    claims: configs/claims_rl.yaml
    shape: {seeds: [..]}            # lab/rl/shape.py
    dpo: {...}                      # the DPO family (lab/rl/dpo_study.py)
"""
from __future__ import annotations

from pathlib import Path

import yaml

from lab.core.errors import ConfigError
from lab.rl.dpo_study import check_seeds, parse_dpo
from lab.rl.grpo_study import BASE_DEFAULTS, TRAIN_DEFAULTS, numbers, parse_modes

__all__ = ["is_rl_study", "is_rl_file", "load_rl_study"]

KEYS = {"study", "results_dir", "device", "seeds", "base", "train", "modes", "dpo", "claims", "shape"}


def is_rl_study(data) -> bool:
    return isinstance(data, dict) and data.get("study") == "rl"


def is_rl_file(path: str | Path) -> bool:
    """Whether ``path`` is a YAML file that says ``study: rl`` (any other file is left to the main study's checks)."""
    try:
        return is_rl_study(yaml.safe_load(Path(path).read_text()))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def _read(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path}: expected a YAML file; found nothing (it does not exist)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping, found {type(data).__name__}")
    return data


def load_rl_study(source: str | Path | dict) -> dict:
    """The study, validated: every key known, numbers where numbers go, every mode buildable (lab/rl/grpo_run.py)."""
    data = dict(source) if isinstance(source, dict) else _read(source)
    where = "the RL study" if isinstance(source, dict) else str(source)
    unknown = set(data) - KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected {', '.join(sorted(KEYS))}")
    seeds = check_seeds(data.get("seeds", [0]), f"{where}: seeds")
    if data.get("device", "cpu") != "cpu":  # grpo_run.py trains on the CPU (the contract's numerics, any machine)
        raise ConfigError(f"{where}: device: the RL study runs on the CPU (device: cpu), got {data['device']!r}")
    out = {"study": "rl", "results_dir": str(data.get("results_dir", "results/rl")), "device": "cpu", "seeds": seeds}
    for block, defaults in (("base", BASE_DEFAULTS), ("train", TRAIN_DEFAULTS)):
        out[block] = {**defaults, **numbers(data.get(block) or {}, defaults, f"{where}: {block}")}
    out["modes"] = parse_modes(data.get("modes"), where)
    claims = data.get("claims")
    if claims is not None and not isinstance(claims, str):
        raise ConfigError(f"{where}: claims: expected the claims file's path, got {claims!r}")
    out["claims"] = claims
    shape = data.get("shape")
    if shape is not None and not (isinstance(shape, dict) and set(shape) == {"seeds"}):
        raise ConfigError(f"{where}: shape: expected {{seeds: [..]}} (lab/rl/shape.py), got {shape!r}")
    out["shape"] = {"seeds": check_seeds(shape["seeds"], f"{where}: shape: seeds")} if shape else None
    out["dpo"] = parse_dpo(data.get("dpo"), f"{where}: dpo")  # the DPO family, or None
    return out

"""The RL study's config (configs/rl.yaml): its settings validated, its runs listed, each run's folder.

    study: rl                       # marks the file as the RL study's (make study, lab validate)
    results_dir: results/rl
    device: cpu                     # the only one: lab/rl/run.py trains on the CPU under the tensor-core contract
    seeds: [0, 1, 2]
    base: {steps: 400, seed: 0}     # the base policy every mode starts from (lab rl-base)
    train: {steps: 60, divisor: 4096, prompts: 16, group: 8, lr: 3.0e-4, census_every: 10}
    modes: {name: {sampler, learner, scaler, loss, fuse}}   (lab/rl/run.py RLMode)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from lab.core.errors import ConfigError

__all__ = ["RLMode", "parse_modes", "is_rl_study", "is_rl_file", "load_rl_study", "rl_runs", "run_folder",
           "TRAIN_DEFAULTS"]

TRAIN_DEFAULTS = {"steps": 60, "divisor": 1, "prompts": 16, "group": 8, "lr": 3.0e-4, "census_every": 10}
BASE_DEFAULTS = {"steps": 400, "seed": 0}
KEYS = {"study", "results_dir", "device", "seeds", "base", "train", "modes"}
FORMATS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class RLMode:
    """One mode of the RL study: the sampler's and the learner's formats, the loss scaler (None: none), the loss."""
    name: str
    sampler: str = "fp32"
    learner: str = "fp32"
    scaler: dict | None = None
    loss: str = "grpo"
    fuse: tuple = ()

    def __post_init__(self):
        for side in ("sampler", "learner"):
            if getattr(self, side) not in FORMATS:
                raise ConfigError(f"mode {self.name}: {side} must be one of {', '.join(FORMATS)}, got "
                                 f"{getattr(self, side)!r}")
        if self.scaler is not None and self.learner != "fp16":
            raise ConfigError(f"mode {self.name}: a loss scaler needs an fp16 learner, got learner {self.learner}")


def parse_modes(modes, where: str) -> dict[str, RLMode]:
    """``modes:`` of an RL config: each a mapping of sampler, learner, scaler, loss, fuse."""
    if not isinstance(modes, dict) or not modes:
        raise ConfigError(f"{where}: expected a mapping `modes: {{name: {{sampler, learner, scaler, loss}}}}`")
    out = {}
    for name, m in modes.items():
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: mode {name}: expected a mapping, got {m!r}")
        unknown = set(m) - {"sampler", "learner", "scaler", "loss", "fuse"}
        if unknown:
            raise ConfigError(f"{where}: mode {name}: unknown key(s) {sorted(unknown)}; expected sampler, learner, "
                              "scaler, loss, fuse")
        if m.get("loss", "grpo") not in ("grpo", "grpo-tis"):
            raise ConfigError(f"{where}: mode {name}: loss must be grpo or grpo-tis, got {m['loss']!r}")
        scaler = m.get("scaler")
        if scaler is not None and not (isinstance(scaler, dict) and "policy" in scaler):
            raise ConfigError(f"{where}: mode {name}: scaler must be null or {{policy: NAME, ...}}, got {scaler!r}")
        out[name] = RLMode(name=name, **{**m, "fuse": tuple(m.get("fuse", ()))})
    return out


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
    """The study, validated: every key known, numbers where numbers go, every mode buildable (lab/rl/run.py)."""
    data = dict(source) if isinstance(source, dict) else _read(source)
    where = "the RL study" if isinstance(source, dict) else str(source)
    unknown = set(data) - KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected {', '.join(sorted(KEYS))}")
    seeds = data.get("seeds", [0])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                      for s in seeds)) or len(set(seeds)) < len(seeds):
        raise ConfigError(f"{where}: seeds: expected a list of distinct ints >= 0, got {seeds!r}")
    if data.get("device", "cpu") != "cpu":  # lab/rl/run.py trains on the CPU (the contract's numerics, any machine)
        raise ConfigError(f"{where}: device: the RL study runs on the CPU (device: cpu), got {data['device']!r}")
    out = {"study": "rl", "results_dir": str(data.get("results_dir", "results/rl")), "device": "cpu", "seeds": seeds}
    for block, defaults in (("base", BASE_DEFAULTS), ("train", TRAIN_DEFAULTS)):
        given = data.get(block) or {}
        if not isinstance(given, dict) or set(given) - set(defaults):
            raise ConfigError(f"{where}: {block}: expected a mapping of {', '.join(defaults)}, got {given!r}")
        merged = {**defaults, **given}
        for k, v in merged.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                    isinstance(defaults[k], int) and not isinstance(v, int)):
                raise ConfigError(f"{where}: {block}.{k}: expected a number >= 0 "
                                  f"({'an int' if isinstance(defaults[k], int) else 'a float'}), got {v!r}")
        out[block] = merged
    out["modes"] = parse_modes(data.get("modes"), where)
    return out


def rl_runs(study: dict) -> list[tuple[str, int]]:
    return [(mode, seed) for mode in study["modes"] for seed in study["seeds"]]


def run_folder(study: dict, mode: str, seed: int) -> Path:
    return Path(study["results_dir"]) / "runs" / mode / f"seed{seed}"

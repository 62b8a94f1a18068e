"""The DPO family of the RL study (configs/rl.yaml's ``dpo:`` block; lab/rl/dpo_run.py runs it): validated, its runs
listed, each run's folder.

    dpo:
      base: {steps: 300, seed: 0}          # the FP32 base on pydoc's pretrain half (lab rl-dpo-base)
      seeds: [30, 31, 32]
      train: {steps: 40, pairs: 16, lr: 1.0e-3, beta: 0.1, census_every: 10, corruption: bigram, k: 1}
      modes:
        dpo-fp32:       {learner: fp32, sum: fp32, scaler: null}
        dpo-fp16-sum16: {learner: fp16, sum: fp16, scaler: {policy: dynamic}}

``learner``: the policy's (and the reference's) forward format (lab.autocast); ``sum``: the format the sequence
log-probability is summed in (fp32, TRL's fix, or the learner's own 16-bit format, trl#878); ``scaler``: a lab loss
scaling policy and its parameters (an fp16 learner only), or null. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab.core.errors import ConfigError

__all__ = ["DPOMode", "parse_dpo", "check_seeds", "dpo_runs", "dpo_run_folder", "DPO_BASE_DEFAULTS", "DPO_TRAIN_DEFAULTS"]

FORMATS = ("fp32", "bf16", "fp16")
CORRUPTIONS = ("bigram", "unigram", "shuffle")  # lab/rl/dpo.py CORRUPTIONS (that module imports torch)
DPO_BASE_DEFAULTS = {"steps": 300, "seed": 0}
DPO_TRAIN_DEFAULTS = {"steps": 40, "pairs": 16, "lr": 1.0e-3, "beta": 0.1, "census_every": 10, "corruption": "bigram",
                      "k": 1}
KEYS = ("base", "seeds", "train", "modes")
MODE_KEYS = ("learner", "sum", "scaler")
CONTINUATION = 48  # lab/rl/dpo_run.py: the tokens of a continuation (k replaces at most all of them)


@dataclass(frozen=True)
class DPOMode:
    """One DPO mode: the learner's format, the sequence sum's format, the loss scaler (None: none)."""
    name: str
    learner: str = "fp32"
    sum: str = "fp32"
    scaler: dict | None = None


def _int(v, where: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"{where}: expected an int >= {low}, got {v!r}")
    return v


def _positive(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{where}: expected a number > 0, got {v!r}")
    return float(v)


def _mapping(value, where: str, keys) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(keys)}, got {value!r}")
    unknown = set(value) - set(keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected {', '.join(keys)}")
    return value


def _mode(name, m, where: str) -> DPOMode:
    where = f"{where}.modes.{name}"
    m = _mapping(m, where, MODE_KEYS)
    learner, total = m.get("learner", "fp32"), m.get("sum", "fp32")
    if learner not in FORMATS:
        raise ConfigError(f"{where}.learner: expected one of {', '.join(FORMATS)}, got {learner!r}")
    if total not in ("fp32", learner):
        raise ConfigError(f"{where}.sum: expected fp32 or the learner's own format ({learner}), got {total!r}")
    scaler = m.get("scaler")
    if scaler is not None:
        if not (isinstance(scaler, dict) and isinstance(scaler.get("policy"), str)):
            raise ConfigError(f"{where}.scaler: expected null or {{policy: NAME, ...}}, got {scaler!r}")
        if learner != "fp16":
            raise ConfigError(f"{where}.scaler: a loss scaler needs an fp16 learner, got learner {learner}")
    return DPOMode(name=str(name), learner=learner, sum=total, scaler=dict(scaler) if scaler is not None else None)


def check_seeds(seeds, label: str) -> list[int]:
    """``seeds`` if it is a non-empty list of distinct ints >= 0; else a ConfigError that starts with ``label``.
    Here, not in lab/rl/study.py or lab/rl/grpo_study.py, which use it too: they import this module."""
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                      for s in seeds)) or len(set(seeds)) < len(seeds):
        raise ConfigError(f"{label}: expected a list of distinct ints >= 0, got {seeds!r}")
    return seeds


def parse_dpo(block, where: str = "dpo") -> dict | None:
    """The ``dpo:`` block, validated: {base, seeds, train, modes: {name: DPOMode}} (None without a block); a
    ConfigError names the key (``where``: how the block is named in messages, e.g. ``configs/rl.yaml: dpo``)."""
    if block is None:
        return None
    block = _mapping(block, where, KEYS)
    base = {**DPO_BASE_DEFAULTS, **_mapping(block.get("base") or {}, f"{where}.base", DPO_BASE_DEFAULTS)}
    base = {"steps": _int(base["steps"], f"{where}.base.steps", 1), "seed": _int(base["seed"], f"{where}.base.seed", 0)}
    seeds = check_seeds(block.get("seeds", [0]), f"{where}.seeds")
    train = {**DPO_TRAIN_DEFAULTS, **_mapping(block.get("train") or {}, f"{where}.train", DPO_TRAIN_DEFAULTS)}
    for k in ("steps", "pairs", "k"):
        train[k] = _int(train[k], f"{where}.train.{k}", 1)
    train["census_every"] = _int(train["census_every"], f"{where}.train.census_every", 0)
    for k in ("lr", "beta"):
        train[k] = _positive(train[k], f"{where}.train.{k}")
    if train["corruption"] not in CORRUPTIONS:
        raise ConfigError(f"{where}.train.corruption: expected one of {', '.join(CORRUPTIONS)}, got "
                          f"{train['corruption']!r}")
    if train["k"] > CONTINUATION:
        raise ConfigError(f"{where}.train.k: expected at most the continuation's {CONTINUATION} tokens, got "
                          f"{train['k']}")
    modes = block.get("modes")
    if not isinstance(modes, dict) or not modes:
        raise ConfigError(f"{where}.modes: expected a mapping {{name: {{learner, sum, scaler}}}}, got {modes!r}")
    return {"base": base, "seeds": seeds, "train": train,
            "modes": {str(name): _mode(name, m, where) for name, m in modes.items()}}


def dpo_runs(dpo: dict) -> list[tuple[str, int]]:
    """Every (mode, seed) of the family."""
    return [(mode, seed) for mode in dpo["modes"] for seed in dpo["seeds"]]


def dpo_run_folder(results_dir: str | Path, mode: str, seed: int) -> Path:
    return Path(results_dir) / "dpo" / "runs" / mode / f"seed{seed}"

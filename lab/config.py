"""Study configuration: load, validate against the schema, and resolve one run's settings.

A study file (configs/*.yaml) names model families, precision/scaling modes and seeds. One training run
is (model, mode, seed); `resolve_run` turns the study into that run's flat, fully defaulted `RunConfig`,
which is what `config.yaml` in the run directory records and what `config_hash` fingerprints.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).parent / "schemas" / "config.schema.yaml"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

TRAIN_DEFAULTS = dict(optimizer="adamw", weight_decay=0.05, momentum=0.9, schedule="onecycle", warmup_pct=0.15,
                      label_smoothing=0.0, grad_clip=None, accum_steps=1, log_every=10, max_steps=None,
                      census_every=20, attribution_replays=32, deterministic=False, checkpoint_every=0,
                      checkpoint_minutes=10.0, checkpoint_keep=1)
DATA_DEFAULTS = dict(path=None, image_size=32, context=64, vocab_size=4096, val_fraction=0.2, split_seed=0,
                     num_workers=0)
CHECKPOINT_KEYS = ("checkpoint_every", "checkpoint_minutes", "checkpoint_keep")
BUILT_IN_DATA = ("digits", "pydoc")  # data sets that ship with the installed packages: no path
STUDY_DEFAULTS = dict(results_dir="results", threads=1, device="auto", policy_modules=[],
                      stats=dict(confidence=0.95, margins=dict(top1=0.01, val_loss=0.05)))


class ConfigError(ValueError):
    """A configuration that cannot be run; the message names the key and what is allowed."""


# --- run configuration: small dataclasses that build their component -----------------------------------
@dataclass
class DataConfig:
    name: str = "digits"
    path: str | None = None
    image_size: int = 32
    context: int = 64
    vocab_size: int = 4096
    val_fraction: float = 0.2
    split_seed: int = 0
    num_workers: int = 0

    def build(self):
        from lab.data import load_data
        return load_data(self.name, self.path, image_size=self.image_size, val_fraction=self.val_fraction,
                         split_seed=self.split_seed, context=self.context, vocab_size=self.vocab_size)


@dataclass
class ModelConfig:
    family: str
    preset: str

    def build(self, num_classes: int, in_chans: int, input_size: int):
        from lab.models import create_model
        return create_model(self.preset, num_classes=num_classes, in_chans=in_chans, input_size=input_size)


@dataclass
class ModeConfig:
    name: str
    precision: str
    scaler: dict | None = None          # {"policy": name, **params}; None means no scaler (fp32, bf16)
    description: str = ""

    def build_scaler(self, device: str):
        from lab import scaling
        if self.precision != "fp16" or not self.scaler:
            return scaling.create("none", enabled=False, device=device)
        params = dict(self.scaler)
        return scaling.create(params.pop("policy"), device=device, **params)


@dataclass
class TrainConfig:
    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "adamw"
    weight_decay: float = 0.05
    momentum: float = 0.9
    schedule: str = "onecycle"
    warmup_pct: float = 0.15
    label_smoothing: float = 0.0
    grad_clip: float | None = None
    accum_steps: int = 1
    log_every: int = 10
    max_steps: int | None = None
    census_every: int = 20          # gradient census every N optimizer steps (lab/numerics.py); 0 = off
    attribution_replays: int = 32   # overflow steps per run replayed to find the first non-finite gradient
    deterministic: bool = False     # torch.use_deterministic_algorithms (CUDA; CPU runs repeat without it)
    checkpoint_every: int = 0       # optimizer steps between checkpoints (lab/checkpoint.py); 0 = by time only
    checkpoint_minutes: float = 10.0  # minutes between checkpoints; 0 = by steps only
    checkpoint_keep: int = 1        # newest checkpoints kept


@dataclass
class RunConfig:
    model: ModelConfig
    mode: ModeConfig
    seed: int
    data: DataConfig
    train: TrainConfig
    device: str = "auto"
    threads: int = 1
    policy_modules: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = copy.deepcopy(d)
        try:
            return cls(model=ModelConfig(**d.pop("model")), mode=ModeConfig(**d.pop("mode")),
                       data=DataConfig(**d.pop("data")), train=TrainConfig(**d.pop("train")), **d)
        except TypeError as e:  # unknown or missing key in a --set or hand-written run config
            raise ConfigError(f"run configuration: {e}") from None

    def hash(self) -> str:
        """Fingerprint of what defines the experiment.

        Thread count, the list of policy modules and the checkpoint settings are recorded but not hashed:
        adding a policy module for a new mode must not re-run the existing ones (the workflow tracks a user
        policy's file instead), and a checkpoint interval does not change a run's result.
        """
        d = self.to_dict()
        d.pop("threads")
        d.pop("policy_modules")
        for key in CHECKPOINT_KEYS:  # how often a run saves itself does not change its result
            d["train"].pop(key)
        return config_hash(d)


def config_hash(d: dict) -> str:
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --- study files ----------------------------------------------------------------------------------------
def deep_merge(base: dict, override: dict) -> dict:
    """Snakemake's rule for several --configfile: nested dicts merge, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_study(paths: list[str | Path] | None = None) -> dict:
    """Read one or more study files (later ones merge over earlier ones) and validate the result."""
    paths = [Path(p) for p in (paths or [DEFAULT_CONFIG])]
    study: dict = {}
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        study = deep_merge(study, loaded)
    return validate_study(study)


def _format_schema_error(err: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in err.absolute_path) or "<top level>"
    if err.validator == "additionalProperties" and isinstance(err.schema.get("properties"), dict):
        allowed = sorted(err.schema["properties"])
        extra = sorted(set(err.instance) - set(allowed))
        return f"{where}: unknown key(s) {', '.join(map(repr, extra))}; allowed keys: {', '.join(allowed)}"
    if err.validator == "enum":
        return f"{where}: {err.instance!r} is not allowed; allowed values: {', '.join(map(str, err.validator_value))}"
    return f"{where}: {err.message}"


def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def import_policy_modules(modules: list[str], base_dir: Path | None = None) -> None:
    """Import user modules (dotted names or .py paths) so that their @register policies exist."""
    for name in modules:
        if name.endswith(".py"):
            path = Path(name) if Path(name).is_absolute() else (base_dir or Path.cwd()) / name
            if not path.is_file():
                raise ConfigError(f"policy_modules: file {path} does not exist")
            mod_name = "lab_user_policy_" + path.stem
            if mod_name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ConfigError(f"policy_modules: cannot import {name!r}: {e}") from None


def validate_study(study: dict) -> dict:
    """Check a study against the schema and the registries; return it with defaults filled in."""
    errors = sorted(jsonschema.Draft202012Validator(_schema()).iter_errors(study), key=lambda e: list(e.path))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(_format_schema_error(e) for e in errors))
    study = deep_merge(STUDY_DEFAULTS, study)
    study["data"] = deep_merge(DATA_DEFAULTS, study["data"])
    study["train"] = deep_merge(TRAIN_DEFAULTS, study["train"])

    from lab import scaling
    from lab.models import available_presets
    import_policy_modules(study["policy_modules"])
    problems = []
    for family, entry in study["models"].items():
        # the data loader checks the format; a path that is not there at all is caught here, before any job
        data = deep_merge(study["data"], entry.get("data", {}))
        where = f"models.{family}.data" if "data" in entry else "data"
        missing = not data["path"] or not Path(data["path"]).expanduser().exists()
        problem = f"{where}.path: {data['name']} needs a local path, and {data['path']!r} does not exist"
        if data["name"] not in BUILT_IN_DATA and missing and problem not in problems:
            problems.append(problem)
        if entry["preset"] not in available_presets():
            problems.append(f"models.{family}.preset: {entry['preset']!r} is not a known preset; "
                            f"allowed values: {', '.join(available_presets())}")
    for name, mode in study["modes"].items():
        scaler = mode.get("scaler")
        if scaler is None:
            continue
        if mode["precision"] != "fp16":
            problems.append(f"modes.{name}.scaler: loss scaling applies to precision fp16 only, "
                            f"not {mode['precision']}")
            continue
        params = {k: v for k, v in scaler.items() if k != "policy"}
        try:
            scaling.create(scaler["policy"], enabled=False, device="cpu", **params)
        except (ValueError, TypeError) as e:
            problems.append(f"modes.{name}.scaler: {e}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return study


# --- one run --------------------------------------------------------------------------------------------
def resolve_run(study: dict, model: str, mode: str, seed: int) -> RunConfig:
    if model not in study["models"]:
        raise ConfigError(f"unknown model {model!r}; the config defines: {', '.join(study['models'])}")
    if mode not in study["modes"]:
        raise ConfigError(f"unknown mode {mode!r}; the config defines: {', '.join(study['modes'])}")
    entry = study["models"][model]
    train = deep_merge(study["train"], entry.get("train", {}))
    data = deep_merge(study["data"], entry.get("data", {}))
    if "image_size" in entry:
        data["image_size"] = entry["image_size"]
    mode_def = study["modes"][mode]
    return RunConfig(
        model=ModelConfig(family=model, preset=entry["preset"]),
        mode=ModeConfig(name=mode, precision=mode_def["precision"], scaler=copy.deepcopy(mode_def.get("scaler")),
                        description=mode_def.get("description", "")),
        seed=int(seed), data=DataConfig(**data), train=TrainConfig(**train),
        device=study["device"], threads=study["threads"], policy_modules=list(study["policy_modules"]))


def apply_overrides(run: RunConfig, assignments: list[str]) -> RunConfig:
    """Apply `key.path=value` overrides (values parsed as YAML) to a resolved run configuration."""
    d = run.to_dict()
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        node, parts = d, key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                if part not in node:
                    raise ConfigError(f"--set {key}: unknown key {part!r}; allowed keys: {', '.join(node)}")
                node[part] = {}
            node = node[part]
        leaf = parts[-1]
        # scaler parameters are open-ended (a policy's own names); everything else must exist already
        if leaf not in node and not (len(parts) >= 2 and parts[-2] == "scaler"):
            raise ConfigError(f"--set {key}: unknown key {leaf!r}; allowed keys: {', '.join(node)}")
        node[leaf] = yaml.safe_load(raw)
    new = RunConfig.from_dict(d)
    if new.mode.scaler is not None and new.mode.precision == "fp16":
        params = {k: v for k, v in new.mode.scaler.items() if k != "policy"}
        from lab import scaling
        try:
            scaling.create(new.mode.scaler.get("policy", "?"), enabled=False, device="cpu", **params)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--set: mode.scaler: {e}") from None
    return new


def policy_source(mode: dict) -> list[str]:
    """The file defining a mode's policy when it is user code outside the lab package (else [])."""
    scaler = mode.get("scaler")
    if mode["precision"] != "fp16" or not scaler:
        return []
    from lab import scaling
    module = sys.modules[scaling.get_policy_class(scaler["policy"]).__module__]
    path = Path(getattr(module, "__file__", "") or "")
    lab_dir = Path(__file__).resolve().parent
    return [] if not path.name or lab_dir in path.resolve().parents else [str(path)]


def family_seeds(study: dict, model: str) -> list[int]:
    """A family's seeds: its own `seeds` when it has them (a noisier family needs more), else the study's."""
    return study["models"][model].get("seeds", study["seeds"])


def study_runs(study: dict) -> list[tuple[str, str, int]]:
    return [(m, mode, s) for m in study["models"] for mode in study["modes"] for s in family_seeds(study, m)]

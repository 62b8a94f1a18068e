"""Study configuration: load, validate against the schema, and resolve one run's settings.

A study file (configs/*.yaml) names model families, precision/scaling modes and seeds. One training run
is (model, mode, seed); `resolve_run` turns the study into that run's flat, fully defaulted `RunConfig`,
which is what `config.yaml` in the run directory records and what `config_hash` fingerprints.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lab.core import files
from lab.core.errors import ConfigError, did_you_mean  # the rest of the lab imports both from config
from lab.core.schema import invalid, schema, schema_errors
from lab.core.study import (base_model_folder, base_of, base_run_of, deep_merge, encoder_run_of, encoder_settings,
                            family_modes, family_seeds, finetune_settings)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"

TRAIN_DEFAULTS = dict(optimizer="adamw", weight_decay=0.05, momentum=0.9, schedule="onecycle", warmup_pct=0.15,
                      label_smoothing=0.0, grad_clip=None, accum_steps=1, emulated_accum=1, log_every=10,
                      max_steps=None, census_every=40, census_fp32_replay=True, attribution_replays=32,
                      deterministic=False, checkpoint_every=0, checkpoint_minutes=10.0, checkpoint_keep=1, faults=[])
DATA_DEFAULTS = dict(path=None, image_size=32, context=64, vocab_size=4096, val_fraction=0.2, split_seed=0,
                     num_workers=0)
CHECKPOINT_KEYS = ("checkpoint_every", "checkpoint_minutes", "checkpoint_keep")
BUILT_IN_DATA = ("digits", "digits-vqa", "pydoc")  # data sets that ship with the installed packages: no path
STUDY_DEFAULTS = dict(results_dir="results", claims_file="configs/claims.yaml", parallel="ddp", threads=1,
                      device="auto", processes_per_run=1, seeds_per_job=1, policy_modules=[],
                      stats=dict(confidence=0.95, margins=dict(top1=0.01, val_loss=0.05)), compare=[])


# --- run configuration: small dataclasses that build their component -----------------------------------
# frozen: a resolved run never changes (RunConfig.hash is computed once); a changed run is a new RunConfig
@dataclass(frozen=True)
class DataConfig:
    name: str = "digits"
    path: str | None = None
    image_size: int = 32
    context: int = 64
    vocab_size: int = 4096
    val_fraction: float = 0.2
    split_seed: int = 0
    num_workers: int = 0
    part: str | None = None  # pretrain | finetune: one half of a text corpus (lab/data/text.py split_parts)

    def build(self):
        from lab.data.datasets import load_data
        return load_data(self.name, self.path, image_size=self.image_size, val_fraction=self.val_fraction,
                         split_seed=self.split_seed, context=self.context, vocab_size=self.vocab_size,
                         part=self.part)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    preset: str
    # LoRA fine-tuning of a base model (lab/models/lora.py): {"base_run": its run folder, "rank", "alpha",
    # "targets", "dropout"}; None: the model trains from its initial weights
    finetune: dict | None = None
    # a vision-language preset's pre-trained encoder (lab/models/multimodal.py): {"run": its run folder, "family",
    # "mode", "seed"}; None: the encoder starts from its initial weights
    encoder: dict | None = None

    def build(self, num_classes: int, in_chans: int, input_size: int, precision: str = "fp32"):
        from lab.models.presets import create_model
        if self.finetune is not None and "base_model" in self.finetune:  # a local Hugging Face folder
            from lab.models.lora import lora_over_hf
            return lora_over_hf(precision=precision, vocab_size=num_classes, context=input_size, **self.finetune)
        model = create_model(self.preset, num_classes=num_classes, in_chans=in_chans, input_size=input_size)
        if self.encoder is not None:
            from lab.models.multimodal import load_encoder
            load_encoder(model, self.encoder["run"])
        if self.finetune is None:
            return model
        from lab.models.lora import lora_over_base
        return lora_over_base(model, precision=precision, **self.finetune)


@dataclass(frozen=True)
class ModeConfig:
    name: str
    precision: str
    scaler: dict | None = None          # {"policy": name, **params}; None means no scaler (fp32, bf16)
    description: str = ""
    reduce_dtype: str = "fp32"          # parallel: fsdp: the gradients' reduce-scatter dtype
    # processes_per_run > 1: "agreed" (found_inf all-reduced) or "per-rank" (each rank alone: a control,
    # configs/fsdp-unscale.yaml)
    overflow_decision: str = "agreed"
    # a training recipe below 16 bits (lab/fp8, lab/fp8/recipes): its name or {name: ..., **settings}; the model's
    # linears run its quantized GEMMs, everything else the mode's precision (bf16). None: no recipe
    recipe: str | dict | None = None
    # quantization-aware training (lab/models/qat.py): torchao's fake quantizers on the model's linears, with these
    # settings ({}: torchao's int8 per-token inputs, int4 weights in groups of 32); None: no fake quantization
    qat: dict | None = None

    def build_recipe(self):
        if self.recipe is None:
            return None
        from lab.fp8 import create_recipe
        return create_recipe(self.recipe)

    def build_scaler(self, device: str):
        from lab import scaling
        if self.precision != "fp16" or not self.scaler:
            return scaling.create("none", enabled=False, device=device)
        params = dict(self.scaler)
        return scaling.create(params.pop("policy"), device=device, **params)


@dataclass(frozen=True)
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
    # FP16 sees each backward at the magnitudes of an N-way accumulated step: the loss is divided by
    # accum_steps * emulated_accum before backward and the unscaled gradient multiplied by emulated_accum in
    # FP32 (exact for a power of two), so FP32 training is unchanged at 1/N of the compute (lab/run/loop.py)
    emulated_accum: int = 1
    log_every: int = 10
    max_steps: int | None = None
    census_every: int = 40          # gradient census every N optimizer steps (lab/numerics/census.py); 0 = off
    census_fp32_replay: bool = True  # FP16 runs: each census step replayed in FP32 to count what FP16 flushed
    attribution_replays: int = 32   # overflow steps per run replayed to find the first non-finite gradient
    deterministic: bool = False     # torch.use_deterministic_algorithms (CUDA; CPU runs repeat without it)
    checkpoint_every: int = 0       # optimizer steps between checkpoints (lab/run/checkpoint.py); 0 = by time only
    checkpoint_minutes: float = 10.0  # minutes between checkpoints; 0 = by steps only
    checkpoint_keep: int = 1        # newest checkpoints kept
    faults: list = field(default_factory=list)  # planted inf/NaN (lab/run/faults.py); [] in every real run
    save_weights: bool = False      # weights.pt at the end: a base model that another family fine-tunes
    adapter_grad_multiplier: float = 1.0  # LoRA: adapters' unscaled gradients x this (the source's x10 callback)
    adapter_lr_multiplier: float = 1.0    # LoRA: adapters' learning rate x this (a parameter group of their own)
    # the source's multimodal remedies (docs/multimodal.md): a branch's gradients clipped on their own, after
    # unscaling ({"encoder": 0.5}: the parameters named encoder.*), and empty-gradient steps before training
    # (forward, scaled backward and the scaler's update on N batches; no weight or optimizer update)
    clip_groups: dict | None = None
    settle_steps: int = 0
    # gradient checkpointing of the GPT's blocks (model.checkpoint_blocks: lab.checkpoint recomputes each block's
    # forward in backward under the forward's precision, the same gradients bit for bit), and the per-position
    # gradients of the final model on one validation batch, FP16 and FP32 against FP64 (lab/numerics/positions.py:
    # positions.csv and metrics pos_*; docs/long-context.md)
    gradient_checkpointing: bool = False
    position_probe: bool = False
    # what the evaluation computes in (lab/run/evaluation.py evaluation_precision): None, as the mode trains (its
    # autocast); "fp32"; "fp16-full", the whole model cast to FP16 (Hugging Face's fp16_full_eval)
    eval_precision: str | None = None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    mode: ModeConfig
    seed: int
    data: DataConfig
    train: TrainConfig
    device: str = "auto"
    threads: int = 1
    policy_modules: list = field(default_factory=list)
    parallel: str = "ddp"               # ddp | fsdp, for a run on several processes (lab/run/sharding.py)

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
        """Fingerprint of what defines the experiment (``_hash``), computed once per RunConfig: it is frozen (a
        changed run is a new one: apply_overrides, dataclasses.replace), and one run carries its RunConfig through
        the run directory's checks, the checkpoints, metrics.json and provenance.json."""
        return self._hash

    @functools.cached_property
    def _hash(self) -> str:
        """The fingerprint itself. Thread count, the list of policy modules and the checkpoint settings are
        recorded but not hashed: adding a policy module for a new mode must not re-run the existing ones (the
        workflow tracks a user policy's file instead), and a checkpoint interval does not change a run's result.
        """
        d = self.to_dict()
        d.pop("threads")
        d.pop("policy_modules")
        for key in CHECKPOINT_KEYS:  # how often a run saves itself does not change its result
            d["train"].pop(key)
        if not d["train"]["faults"]:  # no planted faults: the hash every run had before faults existed
            d["train"].pop("faults")
        if d["parallel"] == "ddp":  # likewise before sharding existed
            d.pop("parallel")
        if d["mode"]["reduce_dtype"] == "fp32":
            d["mode"].pop("reduce_dtype")
        if d["mode"]["overflow_decision"] == "agreed":  # the hash every run had before the control existed
            d["mode"].pop("overflow_decision")
        if d["mode"]["recipe"] is None:  # runs from before recipes existed keep their hash
            d["mode"].pop("recipe")
        if d["mode"]["qat"] is None:  # likewise before quantization-aware training
            d["mode"].pop("qat")
        if d["data"]["part"] is None:  # likewise before corpus parts and fine-tuning existed
            d["data"].pop("part")
        if not d["train"]["save_weights"]:
            d["train"].pop("save_weights")
        for key in ("adapter_grad_multiplier", "adapter_lr_multiplier"):
            if d["train"][key] == 1.0:
                d["train"].pop(key)
        # runs from before they existed
        for key, absent in (("clip_groups", None), ("settle_steps", 0), ("gradient_checkpointing", False),
                            ("position_probe", False), ("eval_precision", None)):
            if d["train"][key] == absent:
                d["train"].pop(key)
        if d["model"]["encoder"] is None:
            d["model"].pop("encoder")
        else:  # likewise the encoder's run folder
            d["model"]["encoder"].pop("run")
        if d["model"]["finetune"] is None:
            d["model"].pop("finetune")
        else:  # where the base's folder is does not define the run (its weights' hash is in metrics.json)
            d["model"]["finetune"].pop("base_run", None)
            d["model"]["finetune"].pop("base_model", None)
        return config_hash(d)


def config_hash(d: dict) -> str:
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --- study files ----------------------------------------------------------------------------------------
def load_study(paths: list[str | Path] | None = None) -> dict:
    """Read one or more study files (later ones merge over earlier ones) and validate the result."""
    paths = [Path(p) for p in (paths or [DEFAULT_CONFIG])]
    study: dict = {}
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"config file {path}: expected a YAML file; found "
                              f"{'a folder' if path.is_dir() else 'nothing'} (it does not exist)")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path}: expected a readable UTF-8 text file; found one that cannot "
                              f"be read ({getattr(e, 'strerror', None) or e})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        study = deep_merge(study, loaded)
    return validate_study(study)


def save_study(study: dict, path: str | Path) -> bool:
    """Write a validated study to ``path`` as YAML (what load_study reads back into the same study), unless the
    file holds exactly that already; True when written. The workflow's jobs read this file rather than the
    config files: it holds the command line's `--config key=value` overrides too. An unchanged study leaves the
    file as it is, modification time included."""
    text = yaml.safe_dump(study, sort_keys=True)
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):  # none yet, or not one this could have written: replaced
        pass
    files.atomic_write_text(path, text)
    return True


def import_policy_modules(modules: list[str], base_dir: Path | None = None) -> None:
    """Import user modules (dotted names or .py paths) so that their @register policies exist."""
    from lab import scaling
    for name in modules:
        before = set(scaling.available())
        if name.endswith(".py"):
            path = Path(name) if Path(name).is_absolute() else (base_dir or Path.cwd()) / name
            if not path.is_file():
                given = "" if name == str(path) else f" (from {name!r})"
                raise ConfigError(f"policy_modules: expected a Python file at {path}{given}; found "
                                  f"{'a folder' if path.is_dir() else 'nothing'} there")
            mod_name = "lab_user_policy_" + path.stem
            if mod_name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # a user's file: a syntax error, a missing import, a bad @register
                sys.modules.pop(mod_name, None)
                raise ConfigError(f"policy_modules: {name!r}: expected a module that imports; found "
                                  f"{type(e).__name__}: {_first_line(e)}") from None
        else:
            if name in sys.modules:
                continue
            mod_name = name
            try:
                importlib.import_module(name)
            except Exception as e:
                sys.modules.pop(name, None)
                raise ConfigError(f"policy_modules: cannot import {name!r}: expected an importable module; found "
                                  f"{type(e).__name__}: {_first_line(e)}") from None
        if set(scaling.available()) == before:  # imported, but no @register ran: nothing a mode can name
            sys.modules.pop(mod_name, None)
            raise ConfigError(f"policy_modules: {name!r}: expected a module that registers a loss-scaling policy "
                              f"(@lab.scaling.register); found none registered by it")


def _source_run_problems(study: dict, family: str, source: tuple[str, str, int], where: str) -> list[str]:
    """A run another family starts from (a fine-tune's base, a vision-language model's encoder) must be one the
    study trains, from scratch: one of its families, modes and seeds."""
    base, mode, seed = source
    if base not in study["models"] or base == family:
        return [f"{where}.family: expected another of the study's families; found {base!r}"
                f"{did_you_mean(base, [f for f in study['models'] if f != family])}"]
    problems = []
    if base_run_of(study, base) is not None or encoder_run_of(study, base):
        problems.append(f"{where}.family: expected a family trained from scratch; {base!r} starts from another run")
    if mode not in family_modes(study, base):
        problems.append(f"{where}.mode: expected one of {base!r}'s modes ({', '.join(family_modes(study, base))}); "
                        f"found {mode!r}")
    if seed not in family_seeds(study, base):
        problems.append(f"{where}.seed: expected one of {base!r}'s seeds {family_seeds(study, base)}; found {seed}")
    return problems


def _finetune_problems(study: dict, family: str, data: dict) -> list[str]:
    """A fine-tuning family's base must be a run the study trains, of the same preset, on the same corpus."""
    source = base_run_of(study, family)
    base = source[0]
    problems = _source_run_problems(study, family, source, f"models.{family}.finetune.base")
    if base not in study["models"] or base == family:
        return problems
    if study["models"][base]["preset"] != study["models"][family]["preset"]:
        problems.append(f"models.{family}.preset: expected the base's preset "
                        f"{study['models'][base]['preset']!r} (its weights are loaded into it); found "
                        f"{study['models'][family]['preset']!r}")
    base_data = deep_merge(study["data"], study["models"][base].get("data", {}))
    same = ("name", "path", "context", "vocab_size", "split_seed")
    if any(base_data[k] != data[k] for k in same):
        problems.append(f"models.{family}.data: expected the base's corpus, context and vocabulary ({', '.join(same)}"
                        f" as {base!r} has them), so that its token ids mean the same words")
    return problems


def _scaler_problem(e: Exception, params: dict) -> str:
    """A policy's refusal, with the values found when it does not say them (GradScaler's own sentences)."""
    msg = _first_line(e)
    if "got " in msg or not params:
        return msg
    return f"{msg} (found {', '.join(f'{k}={v!r}' for k, v in params.items())})"


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return "; ".join(lines) if lines else "(no message)"


def _recipe_problems(name: str, mode: dict) -> list[str]:
    """A mode's recipe: a registered one, with settings it takes, over precision bf16 (the rest of the model)."""
    if mode.get("recipe") is None:
        return []
    if mode["precision"] != "bf16":
        return [f"modes.{name}.recipe: a recipe quantizes the linears of a bf16 model (the rest runs in BF16); "
                f"expected precision bf16, found {mode['precision']}"]
    from lab.fp8 import create_recipe
    try:
        create_recipe(mode["recipe"])
    except ConfigError as e:
        return [f"modes.{name}.recipe: {e}"]
    return []


def _qat_problems(name: str, mode: dict) -> list[str]:
    """A mode's qat settings: lab/models/qat.py's, not beside a recipe (both would replace the same linears)."""
    if mode.get("qat") is None:
        return []
    if mode.get("recipe") is not None:
        return [f"modes.{name}.qat: a mode takes a recipe or qat, not both (each replaces the model's linears)"]
    from lab.models import qat
    try:
        qat.check(mode["qat"], f"modes.{name}.qat")
    except ConfigError as e:
        return [str(e)]
    return []


def validate_study(study: dict) -> dict:
    """Check a study against the schema and the registries; return it with defaults filled in."""
    errors = schema_errors(schema(), study)
    if errors:
        raise invalid(errors)
    study = deep_merge(STUDY_DEFAULTS, study)
    study["data"] = deep_merge(DATA_DEFAULTS, study["data"])
    study["train"] = deep_merge(TRAIN_DEFAULTS, study["train"])

    from lab import scaling
    from lab.models.presets import available_presets
    import_policy_modules(study["policy_modules"])
    problems = []
    for family, entry in study["models"].items():
        train = deep_merge(study["train"], entry.get("train", {}))
        batch, k = train["batch_size"], study["processes_per_run"]
        if batch % k:  # the global batch is split evenly over a run's processes (lab/run/distributed.py)
            problems.append(f"models.{family}: train.batch_size: expected a multiple of processes_per_run ({k}); "
                            f"found {batch}")
        # the data loader checks the format; a path that is not there at all is caught here, before any job
        data = deep_merge(study["data"], entry.get("data", {}))
        where = f"models.{family}.data" if "data" in entry else "data"
        missing = not data["path"] or not Path(data["path"]).expanduser().exists()
        kind = {"text": "a .txt file or folder", "tokens": "folder prepared by `python -m lab prepare-text`"}.get(
            data["name"], "folder")
        found = f"{data['path']!r}, which does not exist" if data["path"] else "no path"
        problem = f"{where}.path: expected the {data['name']} data {kind}; found {found}"
        if data["name"] not in BUILT_IN_DATA and missing and problem not in problems:
            problems.append(problem)
        for mode in entry.get("modes") or []:
            if mode not in study["modes"]:
                problems.append(f"models.{family}.modes: expected the study's modes; found {mode!r}"
                                f"{did_you_mean(mode, study['modes'])}")
        for mode in family_modes(study, family) if study["parallel"] == "fsdp" and study["processes_per_run"] > 1 \
                else []:
            # the evaluation's casts swap whole tensors; a sharded model's parameters are each rank's shards
            if deep_merge(train, study["modes"][mode].get("train", {})).get("eval_precision"):
                problems.append(f"models.{family}, mode {mode}: train.eval_precision does not run under parallel: "
                                "fsdp (sharded weights); evaluate as the mode trains (null)")
        if base_run_of(study, family) is not None:
            problems += _finetune_problems(study, family, data)
        if encoder_run_of(study, family):
            problems += _source_run_problems(study, family, encoder_run_of(study, family), f"models.{family}.encoder")
        folder = base_model_folder(study, family)
        if folder is not None and not (Path(folder).expanduser() / "config.json").is_file():
            problems.append(f"models.{family}.finetune.base_model: expected a local Hugging Face model folder "
                            f"(config.json and weights); found {folder!r}, which has no config.json")
        if folder is not None and "targets" not in entry["finetune"]:  # the default names the lab's GPT's layers
            problems.append(f"models.{family}.finetune.targets: expected the names of the Hugging Face model's "
                            "modules to adapt (e.g. [c_attn] for GPT-2); found none")
        if entry["preset"] not in available_presets():
            problems.append(f"models.{family}.preset: expected a known preset ({', '.join(available_presets())}); "
                            f"found {entry['preset']!r}{did_you_mean(entry['preset'], available_presets())}")
        elif train["faults"]:
            from lab.core import fault_spec
            text = data["name"] in ("pydoc", "text", "tokens")
            size = data["context"] if text else entry.get("image_size", data["image_size"])
            problems += fault_spec.study_problems(family, entry["preset"], train, size)
    for name, mode in study["modes"].items():
        problems += _recipe_problems(name, mode) + _qat_problems(name, mode)
        scaler = mode.get("scaler")
        if scaler is None:
            continue
        if mode["precision"] != "fp16":
            problems.append(f"modes.{name}.scaler: loss scaling applies to precision fp16 only, "
                            f"not {mode['precision']}")
            continue
        if scaler["policy"] not in scaling.available():
            problems.append(f"modes.{name}.scaler.policy: expected a registered loss-scaling policy "
                            f"({', '.join(scaling.available())}); found {scaler['policy']!r}"
                            f"{did_you_mean(scaler['policy'], scaling.available())}")
            continue
        params = {k: v for k, v in scaler.items() if k != "policy"}
        try:
            scaling.check(scaler["policy"], **params)  # the policy's and the engine's checks, without torch
        except (ValueError, TypeError) as e:
            problems.append(f"modes.{name}.scaler: {_scaler_problem(e, params)}")
    problems += _controller_problems(study)
    for i, pair in enumerate(study.get("compare") or []):
        for mode in pair:
            if mode not in study["modes"]:
                problems.append(f"compare[{i}]: expected two of the study's modes; found {mode!r}"
                                f"{did_you_mean(mode, study['modes'])}")
    if problems:
        raise invalid(problems)
    return study


def _controller_problems(study: dict) -> list[str]:
    """A study's fitted scale models (``controllers:``) and held-out runs (``judge:``): every family and mode named
    is the study's, and no model learns from a seed the judge replays (held-out seeds) nor, when named
    ``...-without-F``, from family F (``F`` or ``F_learn``): no leakage (docs/controllers.md)."""
    problems = []

    def runs(where, spec):
        out = set()
        for family, modes in spec.items():
            if family not in study["models"]:
                problems.append(f"{where}: expected one of the study's families; found {family!r}"
                                f"{did_you_mean(family, study['models'])}")
                continue
            for mode in modes:
                if mode not in family_modes(study, family):
                    problems.append(f"{where}.{family}: expected one of the family's modes "
                                    f"({', '.join(family_modes(study, family))}); found {mode!r}")
            out |= {(family, s) for s in family_seeds(study, family)}
        return out

    judged = set()
    for kind, spec in (study.get("judge") or {}).items():
        judged |= runs(f"judge.{kind}", spec)
    judged_seeds = {s for _, s in judged}
    for name, c in (study.get("controllers") or {}).items():
        learned = runs(f"controllers.{name}.learn_from", c["learn_from"])
        shared = sorted({s for _, s in learned} & judged_seeds)
        if shared:
            problems.append(f"controllers.{name}: learns from seeds {shared} that judge: replays (held-out seeds "
                            f"only)")
        _, without, family = name.rpartition("-without-")
        if without and any(f in (family, f"{family}_learn") for f, _ in learned):
            problems.append(f"controllers.{name}: named without {family!r} but learns from it")
    return problems


# --- one run --------------------------------------------------------------------------------------------
def resolve_run(study: dict, model: str, mode: str, seed: int) -> RunConfig:
    if model not in study["models"]:
        raise ConfigError(f"--model: unknown model {model!r}{did_you_mean(model, study['models'])}; expected one "
                          f"of the config's models: {', '.join(study['models'])}")
    if mode not in study["modes"]:
        raise ConfigError(f"--mode: unknown mode {mode!r}{did_you_mean(mode, study['modes'])}; expected one "
                          f"of the config's modes: {', '.join(study['modes'])}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"--seed: expected an integer >= 0; found {seed!r}")
    entry = study["models"][model]
    train = deep_merge(study["train"], entry.get("train", {}))
    data = deep_merge(study["data"], entry.get("data", {}))
    if "image_size" in entry:
        data["image_size"] = entry["image_size"]
    mode_def = study["modes"][mode]
    train = deep_merge(train, mode_def.get("train", {}))  # what the mode itself changes
    if any(base_of(study, f) == (model, mode) or encoder_run_of(study, f)[:2] == (model, mode)
           for f in study["models"]):
        train["save_weights"] = True  # another family fine-tunes this run's model, or takes it as its encoder
    return RunConfig(
        model=ModelConfig(family=model, preset=entry["preset"], finetune=finetune_settings(study, model),
                          encoder=encoder_settings(study, model)),
        mode=ModeConfig(name=mode, precision=mode_def["precision"], scaler=copy.deepcopy(mode_def.get("scaler")),
                        description=mode_def.get("description", ""), reduce_dtype=mode_def.get("reduce_dtype", "fp32"),
                        overflow_decision=mode_def.get("overflow_decision", "agreed"),
                        recipe=copy.deepcopy(mode_def.get("recipe")), qat=copy.deepcopy(mode_def.get("qat"))),
        seed=int(seed), data=DataConfig(**data), train=TrainConfig(**train),
        device=study["device"], threads=study["threads"], policy_modules=list(study["policy_modules"]),
        parallel=study.get("parallel", "ddp"))


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
                    raise ConfigError(f"--set {key}: unknown key {part!r}{did_you_mean(part, node)}; "
                                      f"allowed keys: {', '.join(node)}")
                node[part] = {}
            node = node[part]
        leaf = parts[-1]
        # scaler parameters are open-ended (a policy's own names); everything else must exist already
        if leaf not in node and not (len(parts) >= 2 and parts[-2] == "scaler"):
            raise ConfigError(f"--set {key}: unknown key {leaf!r}{did_you_mean(leaf, node)}; "
                              f"allowed keys: {', '.join(node)}")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: expected a YAML value; found {raw!r} "
                              f"({' '.join(str(e).split())})") from None
    problems = _run_problems(d, run)
    if problems:
        raise ConfigError("--set: " + "; ".join(problems))
    new = RunConfig.from_dict(d)
    if new.mode.scaler is not None and new.mode.precision == "fp16":
        params = {k: v for k, v in new.mode.scaler.items() if k != "policy"}
        from lab import scaling
        try:
            scaling.create(new.mode.scaler.get("policy", "?"), enabled=False, device="cpu", **params)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--set: mode.scaler: {_scaler_problem(e, params)}") from None
    return new


def _run_problems(d: dict, before: RunConfig) -> list[str]:
    """A run configuration's values checked against the schema (what a --set such as train.epochs=abc breaks)."""
    full = schema()
    top = full["properties"]
    run_schema = {"$defs": full["$defs"], "type": "object", "properties": {
        "seed": {"type": "integer", "minimum": 0}, "device": top["device"], "threads": top["threads"],
        "policy_modules": top["policy_modules"], "data": top["data"], "train": top["train"],
        "mode": {"$ref": "#/$defs/mode"},
        "model": {"type": "object", "properties": {"family": {"type": "string"}, "preset": {"type": "string"}}}}}
    mode = {k: v for k, v in d.get("mode", {}).items() if k != "name" and not (k == "scaler" and v is None)}
    problems = schema_errors(run_schema, {**d, "mode": mode})
    preset = d.get("model", {}).get("preset")
    if not problems and preset != before.model.preset:
        from lab.models.presets import available_presets
        if preset not in available_presets():
            problems.append(f"model.preset: expected a known preset ({', '.join(available_presets())}); "
                            f"found {preset!r}{did_you_mean(preset, available_presets())}")
    return problems


def policy_source(mode: dict) -> list[str]:
    """The file defining a mode's policy when it is user code outside the lab package (else [])."""
    scaler = mode.get("scaler")
    if mode["precision"] != "fp16" or not scaler:
        return []
    from lab import scaling
    module = sys.modules[scaling.get_policy_class(scaler["policy"]).__module__]
    path = Path(getattr(module, "__file__", "") or "")
    lab_dir = Path(__file__).resolve().parents[1]
    return [] if not path.name or lab_dir in path.resolve().parents else [str(path)]

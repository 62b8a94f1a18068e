"""The GRPO family of the RL study (configs/rl.yaml's top-level ``seeds``, ``base``, ``train`` and ``modes``;
lab/rl/grpo_run.py runs it): its modes validated, its runs listed, each run's folder. lab/rl/study.py reads the file
as a whole.

    seeds: [0, 1, 2]
    base: {steps: 400, seed: 0}     # the base policy every mode starts from (lab rl-base)
    train: {steps: 60, divisor: 4096, prompts: 16, group: 8, lr: 3.0e-4, census_every: 10}
    modes: {name: {sampler, learner, scaler, loss, correction, fuse, train, seeds, reference}}   (RLMode)

``correction`` (under ``loss: grpo``): a correction of the sampler/learner mismatch, ``{name: token-tis, cap: 2.0}``
(lab/rl/corrections, checked here); ``loss: grpo-tis`` is token-tis with C = 2.

A mode may override the study's ``train`` settings (``train: {steps: 1500, divisor: 0.25}``: the long runs the
scalers' growth rules need) and ``seeds``, and name the mode its Δ is paired with (``reference``; default fp32).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lab.core.errors import ConfigError
from lab.rl.dpo_study import check_seeds

__all__ = ["RLMode", "sampler_name", "parse_modes", "numbers", "rl_runs", "run_folder", "mode_seeds", "mode_train",
           "mode_settings", "TRAIN_DEFAULTS", "BASE_DEFAULTS"]

TRAIN_DEFAULTS = {"steps": 60, "divisor": 1.0, "prompts": 16, "group": 8, "lr": 3.0e-4, "census_every": 10}
BASE_DEFAULTS = {"steps": 400, "seed": 0}
FORMATS = ("fp32", "bf16", "fp16")
MODE_KEYS = {"sampler", "learner", "scaler", "loss", "correction", "fuse", "train", "seeds", "reference"}


@dataclass(frozen=True)
class RLMode:
    """One mode of the RL study: the sampler's and the learner's formats, the loss scaler (None: none), the loss."""
    name: str
    sampler: str | dict = "fp32"  # a format, or a quantized sampler's line (lab/rl/samplers)
    learner: str = "fp32"
    scaler: dict | None = None
    loss: str = "grpo"
    correction: dict | str | None = None        # a correction spec (lab/rl/corrections); None: the loss's own
    fuse: tuple = ()
    train: dict = field(default_factory=dict)   # overrides of the study's train settings
    seeds: tuple | None = None                  # None: the study's seeds
    reference: str = "fp32"                     # the mode its Δ is paired with, seed by seed

    def __post_init__(self):
        if self.learner not in FORMATS:
            raise ConfigError(f"mode {self.name}: learner must be one of {', '.join(FORMATS)}, got {self.learner!r}")
        if isinstance(self.sampler, dict):
            from lab.rl.samplers import check_sampler
            check_sampler(self.sampler, f"mode {self.name}")
        elif self.sampler not in FORMATS:
            raise ConfigError(f"mode {self.name}: sampler must be one of {', '.join(FORMATS)} or a mapping "
                              f"{{path, quant, kv, head_fp32, source}} (lab/rl/samplers), got {self.sampler!r}")
        if self.scaler is not None and self.learner != "fp16":
            raise ConfigError(f"mode {self.name}: a loss scaler needs an fp16 learner, got learner {self.learner}")
        if self.correction is not None:
            if self.loss != "grpo":
                raise ConfigError(f"mode {self.name}: loss {self.loss} is the token-tis correction already; name a "
                                  f"correction under loss grpo, got correction {self.correction!r}")
            from lab.rl.corrections import create_correction
            try:
                create_correction(self.correction)
            except ConfigError as e:  # the unknown correction or setting, with the mode that names it
                raise ConfigError(f"mode {self.name}: {e}") from None

    @property
    def loss_kind(self) -> str:
        """The loss in one word, as metrics.json and runs.csv say it: grpo, grpo-tis, or grpo+CORRECTION."""
        if self.correction is None:
            return self.loss
        from lab.rl.corrections import create_correction
        corrector = create_correction(self.correction)
        return "grpo" if corrector.name == "none" else f"grpo+{corrector!r}"


def sampler_name(spec) -> str:
    """A sampler line in one word for tables and metrics: the format, or ``path+quant`` and its overrides
    (``bf16+fp8-blockwise,kv=current,head_fp32``)."""
    if isinstance(spec, str):
        return spec
    quant = spec.get("quant", "none")
    quant = quant if isinstance(quant, str) else ":".join(
        [str(quant.get("name"))] + [f"{k}={v}" for k, v in quant.items() if k != "name"])
    extra = [f"{k}={spec[k]}" for k in ("kv", "source", "fuse") if k in spec]
    extra += ["head_fp32"] if spec.get("head_fp32") else []
    return ",".join([f"{spec.get('path', 'bf16')}+{quant}"] + extra)


def parse_modes(modes, where: str) -> dict[str, RLMode]:
    """``modes:`` of an RL config: each a mapping of sampler, learner, scaler, loss, fuse."""
    if not isinstance(modes, dict) or not modes:
        raise ConfigError(f"{where}: expected a mapping `modes: {{name: {{sampler, learner, scaler, loss}}}}`")
    out = {}
    for name, m in modes.items():
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: mode {name}: expected a mapping, got {m!r}")
        unknown = set(m) - MODE_KEYS
        if unknown:
            raise ConfigError(f"{where}: mode {name}: unknown key(s) {sorted(unknown)}; expected "
                              f"{', '.join(sorted(MODE_KEYS))}")
        if m.get("loss", "grpo") not in ("grpo", "grpo-tis"):
            raise ConfigError(f"{where}: mode {name}: loss must be grpo or grpo-tis, got {m['loss']!r}")
        scaler = m.get("scaler")
        if scaler is not None and not (isinstance(scaler, dict) and "policy" in scaler):
            raise ConfigError(f"{where}: mode {name}: scaler must be null or {{policy: NAME, ...}}, got {scaler!r}")
        train = numbers(m.get("train") or {}, TRAIN_DEFAULTS, f"{where}: mode {name}: train")
        seeds = m.get("seeds")
        if seeds is not None:
            seeds = tuple(check_seeds(seeds, f"{where}: mode {name}: seeds"))
        out[name] = RLMode(name=name, **{**m, "fuse": tuple(m.get("fuse", ())), "train": train, "seeds": seeds})
    for name, mode in out.items():
        if mode.reference not in out and mode.reference != "fp32":
            raise ConfigError(f"{where}: mode {name}: reference {mode.reference!r} is not a mode")
    return out


def numbers(given, defaults: dict, where: str) -> dict:
    """``given`` checked against ``defaults``' keys and kinds (an int where the default is one; > 0 for a divisor)."""
    if not isinstance(given, dict) or set(given) - set(defaults):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(defaults)}, got {given!r}")
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                isinstance(defaults[k], int) and not isinstance(v, int)) or (k == "divisor" and v <= 0):
            raise ConfigError(f"{where}.{k}: expected a number {'> 0' if k == 'divisor' else '>= 0'} "
                              f"({'an int' if isinstance(defaults[k], int) else 'a float'}), got {v!r}")
    return dict(given)


def mode_seeds(study: dict, mode: str) -> list[int]:
    return list(study["modes"][mode].seeds or study["seeds"])


def mode_train(study: dict, mode: str) -> dict:
    """The train settings of ``mode``: the study's, with the mode's own overrides."""
    return {**study["train"], **study["modes"][mode].train}


def mode_settings(study: dict, mode: str) -> str:
    """What a run of ``mode`` depends on in the config, as text (the workflow reruns a run when it changes)."""
    m = study["modes"][mode]
    # the correction only where a mode names one: the modes that name none keep their text (and their runs)
    settings = (m.sampler, m.learner, m.scaler, m.loss, m.fuse, sorted(mode_train(study, mode).items()))
    return repr(settings if m.correction is None else (*settings, m.correction))


def rl_runs(study: dict) -> list[tuple[str, int]]:
    return [(mode, seed) for mode in study["modes"] for seed in mode_seeds(study, mode)]


def run_folder(study: dict, mode: str, seed: int) -> Path:
    return Path(study["results_dir"]) / "runs" / mode / f"seed{seed}"

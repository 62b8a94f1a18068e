"""What a planted fault is, and whether a model can take it: the checks a study's validation (lab/core/config.py)
and a run (lab/run/train.py) make before anything trains. lab/run/faults.py plants them and describes the format.

Here in core, below run/, so that config's validation needs nothing from the layer above it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lab.core.errors import ConfigError, did_you_mean

INTO = ("activation_grad", "param_grad", "loss", "activation")
VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_TARGET_KEY = {"activation_grad": "module", "param_grad": "param", "loss": None, "activation": "module"}


@dataclass(frozen=True)
class Fault:
    step: int
    into: str
    value: str
    micro: int = 0
    target: str = ""   # module name (activation_grad, activation), parameter name (param_grad), "" (loss)
    rank: int | None = None  # distributed runs: plant on this rank only (None: on every rank)

    def to_dict(self) -> dict:
        return asdict(self)


def parse(specs: list, accum_steps: int = 1, where: str = "train.faults") -> list[Fault]:
    """The config's fault list as Faults; one-line ConfigError naming the entry and key otherwise."""
    faults = []
    for i, spec in enumerate(specs or []):
        at = f"{where}[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{at}: expected a mapping {{step, into, value, ...}}, found {spec!r}")
        into = spec.get("into")
        if into not in INTO:
            raise ConfigError(f"{at}.into: expected one of {', '.join(INTO)}, found {into!r}")
        key = _TARGET_KEY[into]
        for other in ("module", "param"):
            if other in spec and other != key:
                raise ConfigError(f"{at}.{other}: a fault into {into} takes "
                                  f"{'a ' + key if key else 'no module or param'}, found {other}: {spec[other]!r}")
        if key and not isinstance(spec.get(key), str):
            raise ConfigError(f"{at}.{key}: a fault into {into} needs the {key} name, found {spec.get(key)!r}")
        value = spec.get("value")
        if value not in VALUES:
            raise ConfigError(f"{at}.value: expected one of {', '.join(VALUES)} (as strings), found {value!r}")
        step, micro, rank = spec.get("step"), spec.get("micro", 0), spec.get("rank")
        for name, v in (("step", step), ("micro", micro)) + ((("rank", rank),) if rank is not None else ()):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{at}.{name}: expected an integer >= 0, found {v!r}")
        if micro >= accum_steps:
            raise ConfigError(f"{at}.micro: expected < train.accum_steps ({accum_steps}), found {micro}")
        faults.append(Fault(step=step, into=into, value=value, micro=micro, target=spec.get(key, "") if key else "",
                            rank=rank))
    return faults


def check_targets(faults: list[Fault], model: torch.nn.Module, preset: str, where: str = "train.faults") -> None:
    """Every named module and parameter exists in the model (a close match is suggested)."""
    # leaves only: the monitor watches leaf outputs (a container's output is one of its leaves' outputs)
    # activation_grad: leaves only (the monitor watches leaf outputs; a container's output is one of its leaves');
    # activation: any module (the forward range measures every module's output)
    names = {"activation_grad": [n for n, m in model.named_modules() if n and next(m.children(), None) is None],
             "param_grad": [n for n, p in model.named_parameters() if p.requires_grad],
             "activation": [n for n, _ in model.named_modules() if n]}
    for i, f in enumerate(faults):
        if f.into == "loss" or f.target in names[f.into]:
            continue
        key = _TARGET_KEY[f.into]
        what = ("a module" if f.into == "activation" else "a leaf module (one without submodules)" if key == "module"
                else "a parameter")
        raise ConfigError(f"{where}[{i}].{key}: expected {what} of {preset}, found {f.target!r}"
                          f"{did_you_mean(f.target, names[f.into])}")


def check_ranks(faults: list[Fault], world: int, where: str = "train.faults") -> None:
    """A fault for a rank this run does not have would never be planted."""
    for i, f in enumerate(faults):
        if f.rank is not None and f.rank >= world:
            raise ConfigError(f"{where}[{i}].rank: expected a rank below the run's {world} process(es); "
                              f"found {f.rank}")


def check(specs: list, accum_steps: int, build_model, preset: str, world: float = 1,
          where: str = "train.faults") -> list[Fault]:
    """The faults of ``specs``, refused (ConfigError) unless every one can be planted: the list itself, the
    names against ``build_model()`` built on the meta device (no memory), the ranks against ``world``."""
    faults = parse(specs, accum_steps, where)
    if faults:
        with torch.device("meta"):
            model = build_model()
        check_targets(faults, model, preset, where)
        check_ranks(faults, world, where)
    return faults


def study_problems(family: str, preset: str, train: dict, input_size: int) -> list[str]:
    """A study family's planted faults checked before any job runs (names do not depend on the class count or
    the channels; ranks are checked when the run knows its processes)."""
    from lab.models.presets import create_model
    try:
        check(train.get("faults"), train.get("accum_steps", 1),
              lambda: create_model(preset, num_classes=10, in_chans=3, input_size=input_size), preset,
              world=float("inf"), where=f"models.{family}: train.faults")
    except ConfigError as e:
        return [str(e)]
    return []

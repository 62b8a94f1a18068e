"""Planted faults: inf or NaN put at known places, so that a run's counting can be checked against the rule.

``train.faults`` in a config lists them (validated by the schema and by :func:`parse`)::

    faults:
      - {step: 37, into: activation_grad, module: blocks.2.attn.proj, value: inf}
      - {step: 40, into: param_grad, param: head.weight, value: nan}
      - {step: 45, micro: 1, into: loss, value: inf}

``step`` is the 0-based optimizer step (steps.csv's ``step``), ``micro`` the micro-batch within it (default 0;
below ``train.accum_steps``; in a distributed run, ``rank`` plants on that rank only). What is planted:

* ``activation_grad``: the gradient that backward delivers to the named leaf module's output is replaced by a
  tensor filled with ``value``, as if the backward of the module consuming that output had overflowed. The
  monitor's attribution names that module, source ``activation_grad``. Leaf modules only: the monitor watches
  leaf outputs, and a container's output is one of its leaves' outputs.
* ``param_grad``: the named parameter's gradient from that micro-batch is filled with ``value`` (attribution:
  the module owning it, source ``param_grad``).
* ``loss``: the micro-batch's loss is multiplied by ``value``: the loss is non-finite and so is every gradient
  backward computes from it (attribution: the leaf that produced the model's output, ``activation_grad``).

A whole tensor is filled rather than one element, so that no later operation can mask the fault (a ReLU's
backward zeroes one element whose input was negative). A fault plants again when the monitor replays an
overflow step for attribution, because the replay runs the same step's micro-batches. Only the armed
(step, micro) pays anything: other steps run the bare model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lab.core.config import ConfigError, did_you_mean

INTO = ("activation_grad", "param_grad", "loss")
VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_TARGET_KEY = {"activation_grad": "module", "param_grad": "param", "loss": None}


@dataclass(frozen=True)
class Fault:
    step: int
    into: str
    value: str
    micro: int = 0
    target: str = ""   # module name (activation_grad), parameter name (param_grad), "" (loss)
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
    names = {"activation_grad": [n for n, m in model.named_modules() if n and next(m.children(), None) is None],
             "param_grad": [n for n, p in model.named_parameters() if p.requires_grad]}
    for i, f in enumerate(faults):
        if f.into == "loss" or f.target in names[f.into]:
            continue
        key = _TARGET_KEY[f.into]
        what = "a leaf module (one without submodules)" if key == "module" else "a parameter"
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


class FaultPlanter:
    """Hooks a model so that ``arm(step, micro)`` plants that micro-batch's faults; ``planted`` records each
    fault that fired (once per fault, whatever the replays)."""

    def __init__(self, model: torch.nn.Module, faults: list[Fault], rank: int = 0):
        self.faults = list(faults)
        self.rank = rank
        self.planted: list[Fault] = []
        self._armed: list[Fault] = []
        self._handles = []
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        for target in sorted({f.target for f in self.faults if f.into == "activation_grad"}):
            self._handles.append(modules[target].register_forward_hook(self._forward_hook(target)))
        for target in sorted({f.target for f in self.faults if f.into == "param_grad"}):
            self._handles.append(params[target].register_hook(self._param_hook(target)))

    @property
    def steps(self) -> list[int]:
        return sorted({f.step for f in self.faults})

    def arm(self, step: int, micro: int) -> None:
        self._armed = [f for f in self.faults if f.step == step and f.micro == micro and f.rank in (None, self.rank)]

    def disarm(self) -> None:
        self._armed = []

    def _fired(self, f: Fault) -> float:
        if f not in self.planted:
            self.planted.append(f)
        return VALUES[f.value]

    def _armed_for(self, into: str, target: str) -> Fault | None:
        return next((f for f in self._armed if f.into == into and f.target == target), None)

    def _forward_hook(self, target: str):
        def hook(module, args, output):
            f = self._armed_for("activation_grad", target) if self._armed else None
            if f is None or not isinstance(output, torch.Tensor) or output.grad_fn is None:
                return
            # a pre-hook on the node that produced the output replaces the gradient arriving there; registered
            # in this forward hook, which runs before the monitor's (installed later), it comes first, so the
            # monitor's hook on the same node sees the planted gradient
            value, nr = self._fired(f), output.output_nr

            def plant(grad_outputs):
                return tuple(torch.full_like(g, value) if i == nr and g is not None else g
                             for i, g in enumerate(grad_outputs))
            output.grad_fn.register_prehook(plant)
        return hook

    def _param_hook(self, target: str):
        def hook(grad):
            f = self._armed_for("param_grad", target) if self._armed else None
            return None if f is None else torch.full_like(grad, self._fired(f))
        return hook

    def plant_loss(self, loss: torch.Tensor) -> torch.Tensor:
        f = self._armed_for("loss", "") if self._armed else None
        if f is None:
            return loss
        return loss * torch.full((), self._fired(f), dtype=loss.dtype, device=loss.device)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> dict:
        return {"planted": [f.to_dict() for f in self.planted]}

    def load_state_dict(self, state: dict) -> None:
        self.planted = [Fault(**d) for d in state["planted"]]

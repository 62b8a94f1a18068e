"""Corrections of the sampler/learner mismatch in GRPO's loss: what multiplies each token's clipped surrogate.

The sampler drew the tokens with log-probs mu; the learner recomputes them, detached, as pi_old (one update per
batch: the learner's own numbers before the step). A correction reads the per-token log-ratio log rho_t =
log pi_old - log mu over the response tokens and returns, in the shape of the loss's tokens (N, T):

* ``weight``: the factor on each token's clipped surrogate (detached: it changes the measure, not the objective);
* ``keep``: False where the correction rejects the token (its weight is then 0). A rejected token still counts in
  the loss's denominator (the answer mask's count), as TRL's ``*_mask`` modes count it.

Values outside the response mask are not read: the loss masks those tokens. ``clip_against`` says which policy
PPO's ratio is taken against: ``learner`` (pi / pi_old: the mismatch is the weight's to correct) or ``sampler``
(pi / mu, no weight: PPO's clip is the only correction, the ``none`` correction).

One file each in this folder, registered by name as the lab's predictors and recipes are:
``@register_correction("name")`` on a ``Correction`` subclass whose keyword arguments are its settings (type- and
range-checked from the signature, lab/core/settings.py, with did-you-mean for a misspelt one), its ``formula`` and
``equivalent`` (TRL's and verl's names for it) in the docs' table (docs/rl.md, generated). A new correction is that
file and one config line: ``correction: {name: mine, ...}`` in a mode of configs/rl.yaml.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from lab.core.errors import ConfigError, did_you_mean
from lab.core.settings import check_settings, declared_settings

__all__ = ["Correction", "register_correction", "create_correction", "available_corrections", "spec_string",
           "sequence_log_ratio", "CORRECTIONS"]

CORRECTIONS: dict[str, type] = {}


class Correction:
    """Subclass it, take settings as keyword arguments of ``__init__`` (annotated, a range as
    ``Annotated[float, Range(ge=1), "what it does"]``: ``create_correction`` checks them), implement ``weigh``."""

    name: str | None = None          # filled in by @register_correction
    clip_against: str = "learner"    # PPO's ratio: pi / pi_old ("learner") or pi / mu ("sampler")
    formula: str = ""                # the weight, in the docs' words (rho_t = pi_old / mu of token t)
    equivalent: str = ""             # TRL's and verl's settings for the same weight

    def __call__(self, log_old, log_mu, mask):
        """log_old: (N, T) the learner's detached log-probs of the sampled tokens; log_mu: (N, T) the sampler's;
        mask: (N, T) the response tokens (bool or 0/1). Returns (weight, keep), each (N, T)."""
        return self.weigh(log_old - log_mu, mask.bool())

    def weigh(self, log_ratio, mask):
        """log_ratio: (N, T) log rho_t (FP32); mask: (N, T) bool. Returns (weight (N, T), keep (N, T) bool)."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        names = inspect.signature(type(self).__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self" and hasattr(self, k)}

    def __repr__(self) -> str:
        return spec_string(self.name, self.settings())


def sequence_log_ratio(log_ratio, mask, mean: bool = False):
    """(N, 1): each sequence's log-ratio over its response tokens, the sum of log rho_t (the log of the product of the
    ratios, TRL's and verl's sequence level) or, with ``mean``, their mean (the log of the geometric mean: length
    does not compound it). Tokens outside ``mask`` add exactly 0; a sequence without one has log-ratio 0."""
    import torch
    total = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
    if not mean:
        return total
    return total / mask.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)


def register_correction(*names: str):
    """Register a Correction subclass under each of ``names`` (one file in lab/rl/corrections/)."""
    def wrap(cls):
        for name in names:
            if name in CORRECTIONS and CORRECTIONS[name] is not cls:
                raise ValueError(f"correction {name!r} is already registered (by {CORRECTIONS[name].__module__})")
            CORRECTIONS[name] = cls
        cls.name = names[0]
        return cls
    return wrap


def _load() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def available_corrections() -> list[str]:
    _load()
    return sorted(CORRECTIONS)


def spec_string(name: str, settings: dict) -> str:
    """The canonical text of a correction spec: ``name`` or ``name:key=value,...`` (sorted keys)."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in sorted(settings.items())) if settings else "")


def create_correction(spec) -> Correction:
    """A Correction from a spec: ``"token-tis"``, ``"token-tis:cap=3"`` or ``{"name": "token-tis", "cap": 3}``
    (lab.core.settings.parse_spec); unknown names and settings, wrong types and values raise ConfigError naming what
    is allowed."""
    from lab.core.settings import parse_spec
    _load()
    name, params = parse_spec(spec, "correction")
    if name not in CORRECTIONS:
        raise ConfigError(f"unknown correction {name!r}{did_you_mean(name, CORRECTIONS)}; known: "
                          f"{', '.join(sorted(CORRECTIONS))}")
    cls = CORRECTIONS[name]
    check_settings(f"correction {name!r}", declared_settings(cls)[0], params)
    obj = cls(**params)
    obj.name = name
    return obj

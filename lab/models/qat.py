"""Quantization-aware training with torchao's fake quantizers (docs/qat.md): every nn.Linear of
the model but those named in `keep_high` becomes torchao's FakeQuantizedLinear, which rounds its weight (per group
along the input features) and its input (per token) to an integer grid in the forward and passes the gradient
straight through in the backward, masked where the value fell outside the grid's range. The mode's precision and loss
scaling run around it as they do around any model: FP16 autocast casts what the fake quantizer returns, the scaler
scales the loss.

A mode's `qat:` (configs/qat.yaml) names the settings below (`{}`: torchao's int8 per-token activations and int4
weights in groups of 32, the configuration the source's question is asked of: GPTQ / AWQ-style 4-bit weights);
`prepare` calls torchao's `quantize_(model, QATConfig(..., step="prepare"))` with them, nothing else.
"""
from __future__ import annotations

import fnmatch
from typing import Annotated, Literal

from lab.core.errors import ConfigError
from lab.core.settings import Range, check_settings, declared_settings

__all__ = ["prepare", "check", "group_size_problem", "fake_quantized", "resolved", "settings_of", "describe"]


def _config(activation_bits: Annotated[Literal[4, 8] | None, "the inputs' integer width (None: inputs left in the "
                                       "mode's precision, weight-only QAT)"] = 8,
            # torchao's IntxFakeQuantizeConfig takes per_token, per_channel or per_group, none of them per tensor
            activation_granularity: Annotated[Literal["per_token"], "one scale per token (row)"] = "per_token",
            activation_symmetric: Annotated[bool, "symmetric inputs (no zero point); torchao's per-token default "
                                            "is asymmetric"] = False,
            weight_bits: Annotated[Literal[2, 3, 4, 5, 6, 7, 8], "the weights' integer width"] = 4,
            group_size: Annotated[int, Range(ge=1), "weights per scale, along the input features (the weight's "
                                  "in_features must be a multiple)"] = 32,
            keep_high: Annotated[list[str], "module-name patterns (fnmatch) left as plain nn.Linear"] = ()):
    """The settings, checked, as torchao's QATConfig and the filter of the linears it converts."""
    import torch
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    act = None if activation_bits is None else IntxFakeQuantizeConfig(
        getattr(torch, f"int{activation_bits}"), activation_granularity, is_symmetric=activation_symmetric)
    weight = IntxFakeQuantizeConfig(getattr(torch, f"int{weight_bits}"), group_size=group_size)
    return QATConfig(activation_config=act, weight_config=weight, step="prepare"), tuple(keep_high), group_size


def check(settings: dict, what: str = "qat") -> None:
    """A mode's qat settings, refused in one line (unknown key with a did-you-mean, a value its annotation does not
    admit), before anything is built."""
    if not isinstance(settings, dict):
        raise ConfigError(f"{what}: expected a mapping of settings ({{}} for torchao's defaults), got {settings!r}")
    declared, _ = declared_settings(_config)
    check_settings(what, declared, settings)


def prepare(model, **settings):
    """`model` with its linears (but `keep_high`) replaced by torchao's FakeQuantizedLinear, in place; returns it.
    A linear whose in_features is not a multiple of group_size is refused (torchao would fail at its first
    forward), naming it: group_size_problem, which a study's validation and `lab train` ask before any run."""
    from torchao.quantization import quantize_
    problem = group_size_problem(model, settings)
    if problem:
        raise ConfigError(problem)
    config, keep_high, _ = _config(**settings)
    quantize_(model, config, filter_fn=_converted(keep_high))
    return model


def _converted(keep_high):
    """prepare's filter: the model's plain nn.Linear modules whose names no keep_high pattern matches."""
    import torch.nn as nn

    def chosen(module, name):
        return type(module) is nn.Linear and not any(fnmatch.fnmatch(name, p) for p in keep_high)
    return chosen


def group_size_problem(model, settings: dict) -> str | None:
    """The one line refusing ``settings`` for ``model`` (a model built on the meta device will do: only the linears'
    names and in_features are read) when group_size does not divide the in_features of every linear prepare would
    convert; None when it does. Bad settings themselves raise ConfigError (check)."""
    import math
    check(settings)
    s = resolved(settings)
    chosen = _converted(s["keep_high"])
    widths = {n: m.in_features for n, m in model.named_modules() if chosen(m, n)}
    group = s["group_size"]
    ragged = [f"{n} ({w})" for n, w in widths.items() if w % group]
    if not ragged:
        return None
    common = math.gcd(*widths.values())
    divisors = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    more = f" and {len(ragged) - 4} more" if len(ragged) > 4 else ""
    return (f"qat.group_size: {group} does not divide the in_features of {', '.join(ragged[:4])}{more}; expected a "
            f"divisor of every converted linear's in_features ({divisors}), or those linears named in qat.keep_high")


def fake_quantized(model) -> list[str]:
    """The names of the model's fake-quantized linears (what `prepare` converted)."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear
    return [n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)]


def resolved(settings: dict) -> dict:
    """The settings with every default filled in (what a run's report names)."""
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(_config).parameters.items()}
    return {**defaults, **settings, "keep_high": list(settings.get("keep_high", defaults["keep_high"]))}


def settings_of(model) -> dict | None:
    """A model's fake quantizers read back as prepare's settings (from its first FakeQuantizedLinear; keep_high
    omitted), or None where the model has none: what lab.record writes for a loop it did not build."""
    # known by name, as the CPU contract knows torchao's NF4 weight: importing torchao to ask would cost every
    # recording without it torchao's import time
    first = next((m for m in model.modules() if type(m).__name__ == "FakeQuantizedLinear"
                  and type(m).__module__.startswith("torchao.")), None)
    if first is None:
        return None
    import torch
    bits = {getattr(torch, f"int{b}"): b for b in range(1, 9)}
    weight = first.weight_fake_quantizer.config
    out = {"weight_bits": bits.get(weight.dtype), "group_size": getattr(weight.granularity, "group_size", None)}
    if first.activation_fake_quantizer is None:
        return {"activation_bits": None, **out}
    act = first.activation_fake_quantizer.config
    # torchao's names for its granularities (IntxFakeQuantizeConfig's strings): a user's loop may take any of them
    kind = type(act.granularity).__name__
    granularity = {"PerToken": "per_token", "PerAxis": "per_channel", "PerGroup": "per_group"}.get(kind, kind)
    return {"activation_bits": bits.get(act.dtype), "activation_granularity": granularity,
            "activation_symmetric": bool(act.is_symmetric), **out}


def describe(settings: dict) -> str:
    """One line for a report: `int4 weights in groups of 32, int8 per_token inputs (asymmetric)`."""
    s = resolved(settings)
    weights = f"int{s['weight_bits']} weights in groups of {s['group_size']}"
    inputs = ("inputs unquantized" if s["activation_bits"] is None else
              f"int{s['activation_bits']} {s['activation_granularity']} inputs "
              f"({'symmetric' if s['activation_symmetric'] else 'asymmetric'})")
    kept = f", {', '.join(s['keep_high'])} kept high" if s["keep_high"] else ""
    return f"{weights}, {inputs}{kept}"

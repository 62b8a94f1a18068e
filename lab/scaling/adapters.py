"""Trainable parameters a loss scaler can train: FP32 adapters over an FP16 base, FP16 ones refused before step 1.

A LoRA (peft) model over a base loaded with ``.half()`` trains under a loss scaler when its adapters are FP32 (peft's
default): their gradients are FP32 and the scaler unscales them. Adapters cast to FP16 with their base have FP16
gradients: ``torch.amp.GradScaler`` and the lab's engine stop at the first ``unscale_`` with "Attempting to unscale
FP16 gradients.", and a fused optimizer (the transformers Trainer's default AdamW) takes them without a word and
updates the adapters in FP16. :func:`check_trainable_dtypes` says so before the first step, with the fix; the lab's
framework adapters (lab.integrations) call it.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP16_TRAINABLE_FIX", "TrainableDtypeError", "check_trainable_dtypes"]

FP16_TRAINABLE_FIX = (
    "keep the trainable parameters (e.g. LoRA adapters) in FP32 over the FP16 base: peft's "
    "get_peft_model(model, config, autocast_adapter_dtype=True) (its default), or after the fact "
    "peft.tuners.tuners_utils.cast_adapter_dtype(model, adapter_name='default') before the optimizer is built "
    "(it replaces the parameters), or for any model: `for p in model.parameters(): if p.requires_grad: "
    "p.data = p.data.float()`")

_SHOWN = 3  # names given in the message


class TrainableDtypeError(ValueError):
    """Trainable parameters in FP16: a loss scaler cannot unscale their gradients (the message names the fix)."""


def _named(model: Any) -> dict[int, str]:
    modules = [] if model is None else [model] if isinstance(model, torch.nn.Module) else list(model)
    names: dict[int, str] = {}
    for m in modules:
        for name, p in m.named_parameters():
            names.setdefault(id(p), name)
    return names


def _params(obj: Any) -> list[tuple[str | None, torch.Tensor]]:
    """``(name or None, parameter)`` from an optimizer (anything with ``param_groups``), a module, or an iterable of
    parameters or ``(name, parameter)`` pairs."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.named_parameters())
    groups = getattr(obj, "param_groups", None)
    if groups is not None:
        return [(None, p) for g in groups for p in g["params"]]
    out = []
    for item in obj:
        out.append(item if isinstance(item, tuple) else (None, item))
    return out


def check_trainable_dtypes(params_or_optimizer: Any, *, model: Any = None) -> None:
    """Raise :class:`TrainableDtypeError` when a trainable parameter (``requires_grad``) is FP16.

    ``params_or_optimizer``: an optimizer (or a framework's wrapper with ``param_groups``), a module, or an iterable
    of parameters or ``(name, parameter)`` pairs. ``model`` (a module or several) names an optimizer's parameters
    in the message. FP32 adapters over a frozen FP16 base pass; BF16 and FP32 trainable parameters pass."""
    names = _named(model)
    seen: set[int] = set()
    fp16: list[str | None] = []
    for name, p in _params(params_or_optimizer):
        if id(p) in seen or not isinstance(p, torch.Tensor) or not p.requires_grad:
            continue
        seen.add(id(p))
        if p.dtype == torch.float16:
            fp16.append(name or names.get(id(p)))
    if not fp16:
        return
    known = [n for n in fp16 if n]
    shown = f" ({', '.join(known[:_SHOWN])}{', ...' if len(known) > _SHOWN else ''})" if known else ""
    raise TrainableDtypeError(
        f"{len(fp16)} of {len(seen)} trainable parameter(s) are FP16{shown}: a loss scaler cannot unscale FP16 "
        "gradients (torch.amp.GradScaler and the lab's engine stop with 'Attempting to unscale FP16 gradients.'; a "
        f"fused optimizer updates them in FP16). Fix: {FP16_TRAINABLE_FIX}")

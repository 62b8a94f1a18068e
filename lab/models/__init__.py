"""Models: presets.py (the preset registry: `@register_preset`, `create_model`) and gpt.py (the GPT-style decoder
of the language-model family; its gradient checkpointing is lab.numerics.recompute's).
Imports only lab.core and lab.numerics.

Public (docs/api.md), each module imported when first reached (``import lab`` stays light):

    lab.models.qat.prepare         torchao's fake quantizers on a model's linears: quantization-aware training
    lab.models.nf4.quantize_nf4    a QLoRA base: a model's linears as frozen NF4 weights (lab.models.nf4.NF4Linear)
"""
import importlib

_MODULES = ("qat", "nf4")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"lab.models.{name}")
    raise AttributeError(f"module 'lab.models' has no attribute {name!r}")

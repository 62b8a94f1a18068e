"""The lab inside the training frameworks people use: one line each puts a lab scaler in, runs FP16 for real on a
CPU (under the tensor-core contract), honours the FP32 fallback, reports skipped steps from the scaler and records
the run (docs/integrations.md).

    lab.integrations.lightning.LabPrecision       Lightning Trainer:  Trainer(plugins=[LabPrecision("dynamic", ...)])
    lab.integrations.lightning.LabFabricPrecision Lightning Fabric:   Fabric(plugins=[LabFabricPrecision(...)])
    lab.integrations.hf.use_lab_scaler            accelerate:         use_lab_scaler(accelerator, "dynamic", out=...)
    lab.integrations.hf.use_lab_trainer           transformers:       use_lab_trainer(trainer, "dynamic", out=...)

Each module imports its framework; nothing here is imported by ``import lab``: ``lab.integrations.lightning``
imports Lightning when first reached.
"""
import importlib

_MODULES = ("lightning", "hf", "common")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"lab.integrations.{name}")
    raise AttributeError(f"module 'lab.integrations' has no attribute {name!r}")

"""The loss-scaling policies, one file each (or one per family: DeepSpeed's two rules share deepspeed.py), the
shipped ones and yours alike: every module in this folder is imported with ``lab.scaling``, so a module here that
registers a policy (``@lab.scaling.register("name")``) can be named in a config's modes without further wiring
(docs/policies.md, "Example: bounded").

Each one is a :class:`~lab.scaling.base.ScalingPolicy`: it only maps one step's outcome to the next
scale. Scale arithmetic is FP32: the engine stores the scale as a float32 tensor, and the products
are rounded to float32 exactly as the reference implementation does it (``kernel_mul`` reproduces
PyTorch's ``_amp_update_scale_`` kernel, ``fp32_mul`` Megatron-LM's float32 tensor product).

The shipped ones: none.py, static.py, dynamic.py (``torch.amp.GradScaler``'s rule), hysteresis.py (Megatron-LM's),
gradnorm.py (the source study's), warmup.py (and smooth_capped.py, which subclasses it), deepspeed.py (DeepSpeed's
two rules, which import nothing from DeepSpeed), amax.py (amax-history, the scale from the gradients' recent
maxima), amax_predicted.py (amax-history's rule from any predictor of lab/scaling/predictors/) and rl_controller.py
(the loss-scale controller learned in the replay, lab/scaling/learning/). None imports torch at import.
"""
from __future__ import annotations

import importlib
import pkgutil

from .dynamic import DynamicScaling
from .gradnorm import GradNormScaling
from .hysteresis import HysteresisScaling
from .none import NoScaling
from .static import StaticScaling
from .warmup import WarmupScaling

__all__ = ["NoScaling", "StaticScaling", "DynamicScaling", "HysteresisScaling",
           "GradNormScaling", "WarmupScaling"]


def _import_all() -> None:
    """Import every module in this folder, so that a policy file dropped here needs no other registration."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()

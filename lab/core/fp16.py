"""FP16's limits and the rounding bounds of a cast to FP16, all from ``torch.finfo(torch.float16)`` (the formulas:
lab/core/fp16_range.py).

``round16`` is IEEE binary16 round-to-nearest-even (what an FP32 -> FP16 cast does): ``|v| <= UNDERFLOW_BOUND``
rounds to 0, ``|v| >= NORMAL_BOUND`` to a normal number, ``|v| >= OVERFLOW_BOUND`` to inf. The census
(lab/numerics/census.py) classifies with them; the amax-history policy (lab/scaling/policies/amax.py) scales with them.
"""
from __future__ import annotations

import torch

from lab.core.fp16_range import bounds

__all__ = ["MAX", "SMALLEST_SUBNORMAL", "UNDERFLOW_BOUND", "NORMAL_BOUND", "OVERFLOW_BOUND", "amaxes"]

_BOUNDS = bounds(torch.finfo(torch.float16))
#: 65504, the largest finite FP16
MAX = _BOUNDS["MAX"]
#: 2^-24, the smallest positive FP16 value
SMALLEST_SUBNORMAL = _BOUNDS["SMALLEST_SUBNORMAL"]
#: |v| <= 2^-25 rounds to 0 (exactly half of the smallest subnormal is a tie and goes to the even 0)
UNDERFLOW_BOUND = _BOUNDS["UNDERFLOW_BOUND"]
#: |v| >= 2^-14 - 2^-25 rounds to a normal (the tie between the largest subnormal, odd, and 2^-14 goes up)
NORMAL_BOUND = _BOUNDS["NORMAL_BOUND"]
#: |v| >= 65520 rounds to inf: max is (2 - eps) * 2^e, its ulp eps * 2^e; the tie above max (odd) goes up
OVERFLOW_BOUND = _BOUNDS["OVERFLOW_BOUND"]


def amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest absolute value, stacked (FP32, on the tensors' device, no host synchronisation; NaN
    for a tensor holding NaN, inf for one holding inf). CUDA: one fused ``_foreach_norm(inf)``. CPU: ``aminmax``
    per tensor, whose kernel is vectorised where the inf norm's is not (1.8 ms against 0.28 ms for
    resnet50-digits' 50 gradients on one thread), and no copy of the tensors as ``abs`` would make."""
    if not tensors:
        raise ValueError("amaxes needs at least one tensor")
    if tensors[0].device.type == "cuda":
        return torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))])
    # an empty tensor (a rank's empty shard of a small sharded parameter) has nothing above 0
    return torch.stack([torch.stack(t.aminmax()).float().abs().max() if t.numel()
                        else torch.zeros((), dtype=torch.float32, device=t.device) for t in tensors])

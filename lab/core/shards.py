"""Tensors that may be sharded: FSDP2 hands out DTensors (each rank holding a shard of a parameter or gradient).
One place for the two views the lab takes of them (lab/run/sharding.py says what a sharded run does)."""
from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in-place writes reach the DTensor); any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank must call it); any other tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

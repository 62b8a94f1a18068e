"""A run's memory measures: activation_bytes (what autograd saves for backward), peak_memory_mb, and StepMemory (the
training steps' own peak, apart from the lab's replays, evaluation and checkpoints)."""
from __future__ import annotations

import contextlib
import resource

import torch

from lab.core.shards import local_shard
from lab.numerics.precision import autocast_for


def activation_bytes(model, loss_fn, x, y, device, precision) -> int:
    """Bytes of tensors autograd saves for backward in one forward pass (deduplicated by storage).

    Device-independent measure of what mixed precision saves; on CPU peak RSS is dominated by the
    interpreter and libraries, so this is the comparable number there.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from lab.models.nf4 import nf4_storage
    seen: dict[int, int] = {}

    def count(t):
        if is_traceable_wrapper_subclass(t):  # torchao's NF4 weight: its parts hold the storage
            for name in t.__tensor_flatten__()[0]:
                count(getattr(t, name))
        elif t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    def pack(t):
        count(t)
        return t

    # a sharded (FSDP2) parameter is a DTensor: its local shard holds the storage; an NF4 base's weights are
    # weights (buffers), not activations
    keep = nf4_storage(model)
    params = {local_shard(p).untyped_storage().data_ptr() for p in model.parameters()} | {
        b.untyped_storage().data_ptr() for b in model.buffers() if id(b) in keep}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_for(precision, device):
        loss = loss_fn(model(x), y)
    del loss
    return sum(n for ptr, n in seen.items() if ptr not in params)


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepMemory:
    """The peak device memory of the training steps alone. What the lab adds to a run (the census and
    its FP32 replay, which keeps the FP16 step's gradients; overflow-attribution replays; the activation probe;
    evaluation; checkpoints) runs inside :meth:`outside`, which reads the peak so far and resets it around them,
    keeping their own peaks apart: an FP16 run's peak is then its step's, comparable with FP32's. CUDA only (the
    caching allocator's counters): a CPU process's peak RSS covers all of it, and metrics say which they hold.
    ``allocator``: what answers max_memory_allocated / reset_peak_memory_stats (torch.cuda; a test's stand-in)."""
    allocator = None

    def __init__(self, device: str):
        self.device = device
        self.stats = self.allocator or (torch.cuda if device.startswith("cuda") else None)
        self.step_peak, self.outside_peaks = 0, {}
        if self.stats is not None:
            self.stats.reset_peak_memory_stats()

    @contextlib.contextmanager
    def outside(self, what: str):
        if self.stats is None:
            yield
            return
        self.step_peak = max(self.step_peak, self.stats.max_memory_allocated())
        self.stats.reset_peak_memory_stats()
        try:
            yield
        finally:
            self.outside_peaks[what] = max(self.outside_peaks.get(what, 0), self.stats.max_memory_allocated())
            self.stats.reset_peak_memory_stats()

    def metrics(self) -> dict:
        """peak_memory_mb, what it is (memory_kind) and covers (peak_memory_covers), the excluded parts' peaks."""
        if self.stats is None:
            return {"peak_memory_mb": peak_memory_mb(self.device), "memory_kind": "cpu_peak_rss",
                    "peak_memory_covers": "the whole process (peak RSS): training, evaluation, the lab's replays"}
        step = max(self.step_peak, self.stats.max_memory_allocated())
        return {"peak_memory_mb": step / 2**20, "memory_kind": "cuda_max_allocated",
                "peak_memory_covers": "training steps (forward, backward, unscale, optimizer step); not: "
                                      + ", ".join(sorted(self.outside_peaks)),
                **{f"peak_memory_{what}_mb": v / 2**20 for what, v in sorted(self.outside_peaks.items())}}

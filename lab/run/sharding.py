"""One run sharded over its processes with FSDP2 (`parallel: fsdp`, `processes_per_run: K`): what train.py and
the loop do differently from DistributedDataParallel (lab/run/distributed.py).

* ``shard(model, precision, reduce_dtype)``: `fully_shard` on every block (each element of the root's ModuleLists
  and Sequentials) and then on the root, with a `MixedPrecisionPolicy`: parameters computed in the mode's dtype
  (FP16 for an FP16 mode: FSDP's FP16 weights; None for FP32), gradients reduce-scattered in FP32 or, with the mode's
  ``reduce_dtype: fp16``, in FP16 (the K-way sum itself rounded to FP16). The forward still runs under the mode's
  autocast and, on a CPU, the tensor-core contract. Weights tied across blocks (GPT's head and embedding) stay in
  the root's unit.
* the scaler: each rank holds a shard of every gradient; lab/scaling/engine.py agrees found_inf, the maximum and
  the norm over the shards by itself (the global norm from the sum of the shards' squares), as ShardedGradScaler
  agrees found_inf;
* checkpoints: :class:`FullState` gathers the model's and the optimizer's full state dicts on every rank (a
  collective: torch.distributed.checkpoint's state-dict API), rank 0 writes them into the usual checkpoint, and
  every rank loads its shards back from the full dicts: resume is exact and needs the same number of processes;
* evaluation runs on every rank (a sharded forward is collective); rank 0 writes the results. The census and the
  overflow flags see rank 0's shard of each parameter gradient (metrics.json ``numerics_view``); the FP32 census
  replay and the attribution replays are off (a replay on one rank would wait for the others forever).
"""
from __future__ import annotations

import torch

REDUCE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def shard(model: torch.nn.Module, precision: str, reduce_dtype: str = "fp32") -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lab.numerics.precision import DTYPES
    policy = MixedPrecisionPolicy(param_dtype=DTYPES.get(precision), reduce_dtype=REDUCE_DTYPES[reduce_dtype])
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            for block in child:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


class FullState:
    """A checkpoint component for a sharded model and its optimizer: ``gather()`` on every rank (collective), then
    ``state_dict()`` gives the full dicts; ``load_state_dict`` puts each rank's shards back from them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer, self._full = model, optimizer, None

    def gather(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        model, optim = get_state_dict(self.model, self.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self._full = {"model": model, "optimizer": optim}

    def discard(self) -> None:
        self._full = None

    def state_dict(self) -> dict:
        if self._full is None:
            raise RuntimeError("FullState.state_dict() before gather(): every rank gathers first (a collective)")
        full, self._full = self._full, None
        return full

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))


def fsdp_divide_factors(world: int, reduce_dtype: str) -> tuple[float, float]:
    """FSDP2's division of the gradient sum (torch's _get_gradient_divide_factors): an FP16 reduction divides each
    rank's gradient by a power of two near sqrt(world) before the sum and by the rest after (to keep the sum in
    range); FP32 divides the sum by the world size."""
    if reduce_dtype == "fp32":
        return 1.0, float(world)
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre), world / pre


def reduce_like_fsdp(rank_grads: list[torch.Tensor], reduce_dtype: str) -> torch.Tensor:
    """The mean of the ranks' gradients as FSDP2 computes it in ``reduce_dtype``: each divided by the pre-factor
    (in that dtype), summed in rank order in that dtype, divided by the post-factor. A K-way collective may sum in
    another order (a ring); for K = 2 there is one addition, so this is exact."""
    dtype = REDUCE_DTYPES[reduce_dtype]
    pre, post = fsdp_divide_factors(len(rank_grads), reduce_dtype)
    total = None
    for g in rank_grads:
        part = g.to(dtype) / pre if pre != 1 else g.to(dtype)
        total = part if total is None else total + part
    return total / post if post != 1 else total


def reduction_census(rank_grads: list[torch.Tensor]) -> dict:
    """What an FP16 reduction of the ranks' gradients loses against the exact mean (FP64 from the same values) and
    against the FP32 reduction: values the FP32 reduction keeps non-zero that FP16 flushes to zero, finite ones that
    FP16 turns to inf, and the FP16 result's relative error (counts, and the total of non-zero exact values)."""
    exact = torch.stack([g.double() for g in rank_grads]).mean(0)
    fp32, fp16 = reduce_like_fsdp(rank_grads, "fp32").double(), reduce_like_fsdp(rank_grads, "fp16").double()
    nonzero = exact != 0
    return {"values": int(exact.numel()), "nonzero": int(nonzero.sum()),
            "fp32_flushed": int((nonzero & (fp32 == 0)).sum()), "fp16_flushed": int((nonzero & (fp16 == 0)).sum()),
            "fp16_overflow": int((torch.isfinite(exact) & ~torch.isfinite(fp16)).sum()),
            "fp16_max_rel_err": float(((fp16 - exact).abs() / exact.abs())[nonzero & torch.isfinite(fp16)].max())
            if bool((nonzero & torch.isfinite(fp16)).any()) else 0.0}

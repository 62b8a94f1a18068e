"""One run on several processes: `torchrun --nproc-per-node K -m lab train ...` (DistributedDataParallel).

What a distributed run does (lab/run/train.py uses this module):

* the config's ``train.batch_size`` is the global batch: each of the K ranks trains on batch_size / K samples
  per micro-batch (a batch size K does not divide is refused), so a K-process run takes the same optimizer
  steps as a 1-process run of the same config;
* every rank draws the same epoch order from the seed and takes its own contiguous share of each global batch
  (``ResumableRandomSampler(rank=, world=)``, lab/data/datasets.py): the K shares of batch b are exactly the 1-process
  batch b;
* DDP averages the gradients; the loss scaler agrees found_inf and the grad norm across ranks every step
  (``LossScaler.agree_across_ranks``), so an inf on one rank's gradients only makes every rank skip and back
  off together, and the policy's state stays identical;
* only rank 0 writes the run directory (metrics, steps.csv, census, checkpoints); the other ranks write their
  copies to a temporary folder that is removed at the end. The loss logged per step is the mean over ranks.
  The census and overflow attribution run on rank 0's view (its activations, its replay of the step) and
  metrics.json says so (``numerics_view``); BatchNorm statistics are per rank, as in torchvision's reference
  recipe without --sync-bn;
* at the end every rank reports digests of its parameters, of its buffers and of its scale trajectory;
  metrics.json holds them (``rank_param_digests``, ``rank_buffer_digests``, ``rank_scale_digests``),
  ``ranks_agree`` (parameters and scale trajectory equal on every rank) and ``ranks_differ_in`` (which of the three
  differ: buffers such as BatchNorm's running statistics are per rank by design).

Backend: NCCL on CUDA (each rank on cuda:LOCAL_RANK), gloo on CPU (the tests: two processes on one machine).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """This rank's device: cuda:LOCAL_RANK on CUDA, the device itself otherwise."""
        if self.enabled and device == "cuda":
            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return device

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over ranks (in place), e.g. the logged losses."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= self.world
        return t

    def any(self, flags: list[bool], device: str) -> list[bool]:
        """Each flag, true on every rank when it is true on any (a signal that reached one rank first), in one
        all-reduce."""
        if not self.enabled:
            return flags
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or a process launched alone (read from the environment: no process group
    needed)."""
    return os.environ.get("RANK", "0") == "0"


def from_env(device: str) -> Dist:
    """The process's place in a torchrun launch (WORLD_SIZE > 1), its process group started; else one process.

    ``device`` is the resolved device type ("cpu" or "cuda"), which picks the backend."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun")
    d = Dist(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        if device == "cuda":  # NCCL bound to this rank's GPU from the start (no guessing of the device later)
            torch.cuda.set_device(d.local_rank)
            dist.init_process_group(backend="nccl", device_id=torch.device("cuda", d.local_rank))
        else:
            dist.init_process_group(backend="gloo")
    return d


def check_batch(batch_size: int, world: int) -> int:
    """The per-rank micro-batch: the global batch split evenly, or a ConfigError."""
    if batch_size % world:
        from lab.core.config import ConfigError
        raise ConfigError(f"train.batch_size: expected a multiple of the {world} processes (the global batch is "
                          f"split evenly over ranks); found {batch_size}")
    return batch_size // world

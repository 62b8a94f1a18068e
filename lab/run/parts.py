"""The parts a training run is built from: device and seeds, FP32/determinism switches, the precision's
forward context, optimizer and schedule, the loss, evaluation and the memory measures (lab/run/train.py runs
them)."""
from __future__ import annotations

import contextlib
import math
import os
import random
import resource

import numpy as np
import torch
import torch.nn.functional as F

from lab.core.shards import local_shard
from lab.numerics.contract import tensor_core_contract

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was requested but torch.cuda.is_available() is False")
    return name


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# glibc's mallopt parameters (malloc.h): memory freed by one step is kept for the next instead of returned to the OS
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> dict:
    """Let glibc's malloc keep the memory a training step frees, for the next step to reuse.

    By default glibc serves every allocation above a threshold (128 KiB, raised as such blocks are freed) with a fresh
    mmap and returns trimmed heap memory to the OS; the next step then touches new pages, and each first touch is a
    page fault that zeroes 4 KiB. On a CPU step of the study's models that cost ~900-2800 page faults per step and
    ~5-10% of the step, more in FP16, whose casts allocate more tensors (tests/test_train.py counts them). With the
    heap kept (no mmap below 1 GiB, no trimming), a step reuses the pages of the one before: the process's peak memory
    is the same, and it is held until exit. No-op where the C library has no mallopt (not glibc)."""
    import ctypes
    import ctypes.util
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return {"malloc_keep_freed": False}
    ok = all(mallopt(opt, value) == 1 for opt, value in ((_M_MMAP_THRESHOLD, 1 << 30),
                                                         (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20)))
    return {"malloc_keep_freed": ok}


def set_true_fp32(device: str) -> dict:
    """FP32 means FP32: no TF32 in matmuls or convolutions (timm's benchmarks leave it on)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {"tf32": False}


def set_fp32_reductions() -> dict:
    """FP16 and BF16 matmuls reduce in FP32, as the CPU contract computes them (low-precision operands, FP32
    accumulation, one rounding of the result; docs/fp16-cpu.md): cuBLAS's reduced-precision split-K reductions,
    which torch allows by default, are turned off, and the switches recorded (no effect on a CPU)."""
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return {"fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}


def set_deterministic(on: bool) -> dict:
    """train.deterministic: PyTorch's deterministic algorithms (an error for an op that has none) and
    cuDNN without autotuning (on otherwise: it picks the fastest convolution kernels). A CPU run with the
    same config, seed, thread count and machine repeats itself bit for bit without it
    (tests/test_resume.py::test_same_config_and_seed_repeat_exactly); on CUDA some kernels (atomic adds in
    backward) are nondeterministic unless this is on."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first call
    if on or torch.are_deterministic_algorithms_enabled():  # the call imports torch._inductor: ~2 s a run
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on  # autotuning picks the fastest kernels, not the same ones each run
    return {"deterministic": on, "cudnn_benchmark": not on}


def autocast_for(precision: str, device: str):
    """The forward-pass context of a precision: autocast, plus on CPU the tensor-core contract
    (lab.numerics.contract)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device, dtype=DTYPES[precision]))
    if device == "cpu":
        stack.enter_context(tensor_core_contract())
    return stack


@contextlib.contextmanager
def autocast_off():
    """Run code in FP32 even where it enters autocast itself: every ``torch.autocast`` region entered inside is
    entered disabled. A recorded loop's ``replay=`` closure (lab/run/record.py) holds its own autocast; its FP32
    census replay runs it under this. Restored on exit; single-threaded use (it patches autocast's ``__enter__``)."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave = cls.__enter__, cls.__exit__

    def disabled_enter(self):
        # an instance can outlive the block (accelerate wraps forward in one autocast object): its own setting
        # comes back when the region is left
        self._lab_enabled, self._enabled = self._enabled, False
        return enter(self)

    def restoring_exit(self, *exc):
        try:
            return leave(self, *exc)
        finally:
            if hasattr(self, "_lab_enabled"):
                self._enabled = self._lab_enabled
                del self._lab_enabled

    cls.__enter__, cls.__exit__ = disabled_enter, restoring_exit
    try:
        with torch.autocast("cpu", enabled=False):
            yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave


def build_optimizer(cfg, params):
    t = cfg.train
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def param_groups(cfg, model) -> list[dict]:
    """The trainable parameters: one group, or (train.adapter_lr_multiplier) LoRA adapters in a group of their own
    at that multiple of the learning rate."""
    from lab.numerics.adapters import is_adapter
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    k = cfg.train.adapter_lr_multiplier
    if k == 1.0:
        return [{"params": [p for _, p in named]}]
    groups = [{"params": [p for n, p in named if not is_adapter(n)]},
              {"params": [p for n, p in named if is_adapter(n)], "lr": cfg.train.lr * k}]
    return [g for g in groups if g["params"]]


def build_schedule(cfg, optimizer, total_steps: int):
    t = cfg.train
    if t.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                   total_steps=max(total_steps, 1),
                                                   pct_start=t.warmup_pct)
    if t.schedule == "cosine":
        warm = max(1, int(t.warmup_pct * total_steps))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / max(total_steps, 1)))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def flat_cross_entropy(label_smoothing: float = 0.0):
    """Cross-entropy over the last dimension of the logits, every other dimension flattened into rows: one
    label per sample for a classifier (batch, classes), one per token for a language model (batch, time,
    vocab)."""
    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               label_smoothing=label_smoothing)
    return loss


#: bytes per logit an evaluation batch holds at its peak: the model's half-precision output, its FP32 copy and the
#: loss's log-softmax (2 + 4 + 4)
EVAL_LOGIT_BYTES = 10
#: what one evaluation batch's logits may take: GPT-2 small's are 1024 x 50,257 per window (515 MB by the count
#: above), so 256 windows would need 132 GB after all of training (issue 40)
EVAL_LOGITS_BUDGET = 2 * 2**30


def eval_batch_size(task: str, num_classes: int, input_size: int, batch_size: int,
                    budget: int = EVAL_LOGITS_BUDGET) -> int:
    """Examples per evaluation batch: the training batch, at least 256, as long as the batch's logits fit
    ``budget`` (EVAL_LOGIT_BYTES per logit; a language model has context x vocabulary of them per window)."""
    logits = num_classes * (input_size if task == "lm" else 1)
    return max(1, min(max(256, batch_size), budget // (logits * EVAL_LOGIT_BYTES)))


def score_batch(model, x, y, forward_context):
    """One evaluation batch on the device: (each example's hit as bool, its cross-entropy in FP32), one per image
    or per next token. What evaluate runs per batch and lab/run/sizing.py traces without data."""
    with forward_context:
        logits = model(x)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    return logits.argmax(-1) == y.reshape(-1), F.cross_entropy(logits, y.reshape(-1), reduction="none")


@torch.no_grad()
def evaluate(model, loader, device: str, precision: str, per_example: bool = False, prepare=None):
    """Validation top-1 (next-token accuracy for a language model) and mean cross-entropy in nats.

    With ``per_example`` also each example's outcome, in the loader's order (one per image, or per next token):
    (top1, loss, correct as a bool array, loss as a float32 array). The study's statistics resample examples
    (lab/study/inference.py): the test set is a sample too. Memory: one batch's logits at a time (eval_batch_size).
    ``prepare``: what a batch needs on the device before the model (DataBundle.prepare).
    """
    model.eval()
    correct = total = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    hits, losses = [], []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if prepare is not None:
            x = prepare(x)
        hit, loss = score_batch(model, x, y, autocast_for(precision, device))
        correct += hit.sum()
        loss_sum += loss.double().sum()
        total += y.numel()
        if per_example:
            hits.append(hit.cpu())
            losses.append(loss.cpu())
    model.train()
    top1, mean_loss = float(correct) / max(total, 1), float(loss_sum) / max(total, 1)
    if not per_example:
        return top1, mean_loss
    return (top1, mean_loss, torch.cat(hits).numpy().astype(bool) if hits else np.zeros(0, bool),
            torch.cat(losses).numpy().astype(np.float32) if losses else np.zeros(0, np.float32))


def rank_slice(n: int, rank: int, world: int) -> list[int]:
    """The validation examples one rank of a sharded run scores: a contiguous ceil(n / world), the last rank's
    padded with copies of the last example, so that every rank runs the same number of (collective) forwards."""
    per = -(-n // world)
    return [min(i, n - 1) for i in range(rank * per, (rank + 1) * per)]


def evaluate_sharded(model, loader, device: str, precision: str, d, n_examples: int, prepare=None):
    """evaluate on a sharded model whose ranks each hold a rank_slice of the validation set (``loader``): every
    rank's outcomes gathered in rank order, the padding dropped; (top1, loss, correct, loss per example) on every
    rank, equal to one process scoring the whole set (tests/test_evaluation.py)."""
    _, _, correct, loss = evaluate(model, loader, device, precision, per_example=True, prepare=prepare)
    parts = d.gather((correct, loss))
    per_example = len(correct) // max(len(loader.dataset), 1)  # next tokens per window for the LM, else 1
    correct = np.concatenate([c for c, _ in parts])[:n_examples * per_example]
    loss = np.concatenate([v for _, v in parts])[:n_examples * per_example]
    return float(correct.mean()) if len(correct) else 0.0, float(loss.astype(np.float64).mean()), correct, loss


def activation_bytes(model, loss_fn, x, y, device, precision) -> int:
    """Bytes of tensors autograd saves for backward in one forward pass (deduplicated by storage).

    Device-independent measure of what mixed precision saves; on CPU peak RSS is dominated by the
    interpreter and libraries, so this is the comparable number there.
    """
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    # a sharded (FSDP2) parameter is a DTensor: its local shard holds the storage
    params = {local_shard(p).untyped_storage().data_ptr() for p in model.parameters()}
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
    """The peak device memory of the training steps alone (issue 40). What the lab adds to a run (the census and
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


def check_batches(t, train_samples: int) -> None:
    """An epoch must hold at least one optimizer step (full batches only: the loader drops the last one)."""
    batches = train_samples // t.batch_size
    if batches < t.accum_steps:
        from lab.core.config import ConfigError
        raise ConfigError(f"train.accum_steps: expected at most the {batches} batches of {t.batch_size} in an "
                          f"epoch of {train_samples} training samples; found {t.accum_steps}: lower accum_steps "
                          "or batch_size")

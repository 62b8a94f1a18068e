"""What a run sets in its process before it trains: the device, the seeds, the allocator (freed memory kept for the
next step) and the FP32 and determinism switches (lab/run/train.py calls them; the values they return are recorded)."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


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

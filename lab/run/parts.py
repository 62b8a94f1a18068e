"""Deprecated: lab.run.parts was split into modules named for what they hold; this shim goes in the next release.

    lab.numerics.precision  DTYPES, autocast_for, autocast_off (and lab.autocast, the public FP16 context)
    lab.run.process         resolve_device, seed_everything, keep_freed_memory, set_true_fp32, set_fp32_reductions,
                            set_deterministic
    lab.run.optim           build_optimizer, param_groups, build_schedule, check_batches
    lab.run.evaluation      flat_cross_entropy, EVAL_LOGIT_BYTES, EVAL_LOGITS_BUDGET, eval_batch_size, score_batch,
                            evaluate, rank_slice, evaluate_sharded
    lab.run.memory          activation_bytes, peak_memory_mb, StepMemory
"""
from __future__ import annotations

import warnings

from lab.numerics.precision import DTYPES, autocast_for, autocast_off
from lab.run.evaluation import (EVAL_LOGIT_BYTES, EVAL_LOGITS_BUDGET, eval_batch_size, evaluate, evaluate_sharded,
                                flat_cross_entropy, rank_slice, score_batch)
from lab.run.memory import StepMemory, activation_bytes, peak_memory_mb
from lab.run.optim import build_optimizer, build_schedule, check_batches, param_groups
from lab.run.process import (keep_freed_memory, resolve_device, seed_everything, set_deterministic,
                             set_fp32_reductions, set_true_fp32)

__all__ = ["DTYPES", "autocast_for", "autocast_off", "EVAL_LOGIT_BYTES", "EVAL_LOGITS_BUDGET", "eval_batch_size",
           "evaluate", "evaluate_sharded", "flat_cross_entropy", "rank_slice", "score_batch", "StepMemory",
           "activation_bytes", "peak_memory_mb", "build_optimizer", "build_schedule", "check_batches", "param_groups",
           "keep_freed_memory", "resolve_device", "seed_everything", "set_deterministic", "set_fp32_reductions",
           "set_true_fp32"]

warnings.warn("lab.run.parts is deprecated and goes in the next release: import from lab.numerics.precision "
              "(autocast_for, autocast_off, DTYPES; your own FP16 context: lab.autocast), lab.run.process (device, "
              "seeds, FP32/determinism switches), lab.run.optim (optimizer, schedule), lab.run.evaluation (loss, "
              "evaluate) or lab.run.memory (memory measures)", DeprecationWarning, stacklevel=2)

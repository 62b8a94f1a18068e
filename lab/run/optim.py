"""A run's optimizer and learning-rate schedule: build_optimizer, param_groups (LoRA adapters at their own rate),
build_schedule, and check_batches (an epoch holds at least one optimizer step)."""
from __future__ import annotations

import math

import torch


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


def check_batches(t, train_samples: int) -> None:
    """An epoch must hold at least one optimizer step (full batches only: the loader drops the last one)."""
    batches = train_samples // t.batch_size
    if batches < t.accum_steps:
        from lab.core.config import ConfigError
        raise ConfigError(f"train.accum_steps: expected at most the {batches} batches of {t.batch_size} in an "
                          f"epoch of {train_samples} training samples; found {t.accum_steps}: lower accum_steps "
                          "or batch_size")

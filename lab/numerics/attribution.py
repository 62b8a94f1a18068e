"""Overflow attribution: which layer's gradient turned non-finite first, in backward order.

lab/numerics/monitor.py (``NumericsMonitor(attribute=True)``, for runs with a loss scaler) calls these. On a step the scaler skipped for
overflow, the parameters are still those the step's backward ran on, so the loop passes ``end_step`` a
``replay`` that runs the step's forward and scaled backward again (same micro-batches, autocast, loss
scale, random-generator state). During the replay every leaf module's output gradient and every
parameter gradient carries a finiteness flag, in the order backward computes them; the first false flag
names the layer and its source (``activation_grad``: the gradient at that module's output, which the
backward of the module consuming it produced; ``param_grad``: its parameters). Parameter-free modules
(activations, pooling) are named too. The replay changes nothing training depends on: buffers
(BatchNorm statistics) and generator states are restored, so a run's trajectory is the same with or
without it; the skipped step's gradients are discarded (``.grad`` None, as the loop's zero_grad leaves
them), so a replay needs no more memory than a training step. Its cost, one forward and backward per
replayed step, falls on overflow steps only, at most ``replay_limit`` per run (lab/run/train.py passes
``train.attribution_replays``; a replay that runs out of memory ends the replays and is logged). After
that (and from the start with ``replay_limit=0``, which lab/run/train.py uses for policies that do not skip
overflow steps) ``after_backward`` flags each parameter gradient before unscale_ and clipping
(one fused max-abs pass per step: up to ~5% of a CPU step, benchmarks/speed/bench_attribution.py), and an
overflow step names the module whose parameter gradient was the first non-finite one in the backward
order recorded on census steps (source ``param_grad``). A replay that finds nothing non-finite (a
nondeterministic kernel) leaves the step unattributed (""). The same replay measures the forward range
(lab/numerics/forward_range.py). One host read each.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from lab.core.fp16 import amaxes
from lab.core.shards import local_shard
from lab.numerics.forward_range import first_beyond, range_hooks
from lab.numerics.micro import for_each_grad_output, on_gradient

__all__ = ["ACTIVATION", "PARAM", "flagged_replay", "grad_flags", "first_nonfinite_owner"]

ACTIVATION, PARAM = "activation_grad", "param_grad"  # census.csv sources; also where a step's inf was first


def flagged_replay(model: torch.nn.Module, leaves: list, owners: list, replay: Callable[[], None]
                   ) -> tuple[str, str, tuple | None]:
    """Run ``replay`` with a finiteness flag on every gradient; the first non-finite (layer, source) ("", "" if
    none), and the forward range: the first module, in the order the modules finish their forward, whose output left
    FP16's range (name, class, max |output|, max |own weights|), or None. One host read for all of it."""
    flags: list[tuple[str, str, torch.Tensor]] = []  # in the order backward computes them
    outputs: list[tuple[str, str, torch.Tensor]] = []  # (module, its class, max |output|), forward order
    weights: list[torch.Tensor] = []  # max |w| over each such module's own parameters (0: none)

    def flag(layer: str, source: str, g: torch.Tensor | None) -> None:
        if g is not None:
            flags.append((layer, source, torch.isfinite(g).all()))

    def forward_hook(name, module, args, output):
        for_each_grad_output(output, lambda t: on_gradient(t, functools.partial(flag, name, ACTIVATION)))

    handles = [m.register_forward_hook(functools.partial(forward_hook, name)) for name, m in leaves]
    handles += range_hooks(model, outputs, weights)
    handles += [p.register_post_accumulate_grad_hook(lambda p, layer=layer: flag(layer, PARAM, p.grad))
                for layer, ps in owners for p in ps]
    try:
        replay()
        n, m = len(flags), len(outputs)
        every = [f.float() for _, _, f in flags] + [a for _, _, a in outputs] + weights
        values = torch.stack([v.to(every[0].device) for v in every]).tolist() if every else []  # one sync
    finally:
        for h in handles:
            h.remove()
    forward = first_beyond(outputs, values[n:n + m], values[n + m:])  # beyond 65504, inf or NaN
    for (layer, source, _), ok in zip(flags, values[:n]):
        if not ok:
            return layer, source, forward
    return "", "", forward


def grad_flags(owners: list) -> tuple[list[str], torch.Tensor] | None:
    """Per parameter gradient (of the scaled loss, before unscale_): its owner, and the maxima of all of them as one
    device tensor (inf/NaN exactly where a gradient holds one; no sync). None without gradients."""
    layers, grads = [], []
    for layer, params in owners:
        for p in params:
            if p.grad is not None:
                layers.append(layer)
                grads.append(local_shard(p.grad))  # FSDP2: this rank's shard
    if not grads:
        return None
    return layers, amaxes(grads)  # lab.core.fp16.amaxes: one pass each


def first_nonfinite_owner(flags: tuple[list[str], torch.Tensor] | None, owners: list,
                          backward_rank: dict[str, int]) -> str:
    """The owner of the first non-finite parameter gradient in backward order ("" if none is)."""
    if flags is None:
        return ""
    layers, finite = flags
    bad = {layer for layer, ok in zip(layers, finite.tolist()) if not ok}  # the one host sync
    if not bad:
        return ""
    # backward order as recorded; owners it never saw (none, normally) by reverse definition order
    defined = {layer: i for i, (layer, _) in enumerate(owners)}
    return min(bad, key=lambda layer: (backward_rank.get(layer, math.inf), -defined[layer]))

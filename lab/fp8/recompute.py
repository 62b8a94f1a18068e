"""A recipe layer's forward in a checkpointed region (lab/numerics/recompute.py): the recompute quantizes with the
forward's delayed-scaling amaxes and draws the forward's stochastic-rounding bits, and it neither pushes amaxes into
the history nor counts the census again. Without checkpointing the layer runs as before."""
from __future__ import annotations

import contextlib

from lab.numerics.recompute import as_in_forward


def _clone(t):
    return None if t is None else t.clone()  # history_amax may be a view of the history, which the push changes


def _scales(layer):
    return layer.history_amax("input"), layer.history_amax("weight")


def _now(layer):
    bits = None if layer.generator is None else layer.generator.get_state()
    return (*map(_clone, _scales(layer)), bits)


@contextlib.contextmanager
def forward_state(layer):
    """Yields ``(amax_x, amax_w, fresh)`` for a RecipeLinear's forward GEMM: the scales it quantizes with, and
    whether it advances the layer's state (False in a recompute: the forward pushed and counted already)."""
    replayed = as_in_forward(lambda: _now(layer))
    if replayed is None:
        yield (*_scales(layer), True)
        return
    amax_x, amax_w, bits = replayed
    census, layer.census = layer.census, False
    after = None if bits is None else layer.generator.get_state()
    if bits is not None:
        layer.generator.set_state(bits)  # the forward's draws again; backward's draws go on from where they were
    try:
        yield amax_x, amax_w, False
    finally:
        layer.census = census
        if after is not None:
            layer.generator.set_state(after)

"""Per-block scaling of FP16's backward: each block of a chain gets its own power-of-two scale.

One loss scale S serves every layer alike: the layer with the largest gradients sets it, and a block whose gradients
are far smaller flushes values to zero that a scale of its own would keep. Adaptive loss scaling (Zhao et al. 2019,
arXiv:1910.12385) gives each layer its own scale; here the layers are the blocks of a chain (GPT or ViT blocks,
ResNet stages) and the scale rides on the gradient itself:

* at each block's output an identity autograd Function multiplies the incoming gradient by a power of two ``r_l``
  (in the dtype the forward produced there: FP32 on a pre-norm Transformer's residual stream under autocast), so
  block l's backward runs at ``S * c_l`` with ``c_l = prod_{j >= l} r_j``; at the first block's input a second
  Function divides by ``c_0``: everything outside the blocks (an embedding, a stem, a head, a weight tied between
  both ends) stays at the loss scale S;
* ``c_l`` is amax-history's rule (lab/scaling/policies/amax.py) per block, as tensor ops (no host synchronisation): the
  largest power of two with ``S * c_l * M_l <= 65504 / 2**margin``, where ``M_l`` is the largest of the last
  ``history`` steps' observations of block l (or what another ``predictor`` predicts from them, lab/scaling/
  predictors): the unscaled maximum of its parameter gradients and of the gradient
  at its output, from each training backward (a micro-batch's, as FP16 held them). The parameter gradients are
  often the largest: a weight's gradient sums its input's rows (1024 tokens a backward in the study's LM), so a
  factor set from the block's incoming gradient alone overflowed them in a test chain. An overflow (inf/NaN)
  observes the least maximum that explains it, halving that block's scale; an all-zero gradient observes the
  largest value FP16 would flush (an upper bound). Until a block has an observation its factor is 1;
* before the engine unscales, each block's parameter gradients are observed and divided by ``c_l`` (exact: powers
  of two, in FP32), so the engine sees every gradient at S and unscales, checks inf/NaN and skips as always.

The factors are set when a step starts (the engine's first ``scale()`` after ``update()``) and kept for all of its
backward passes: the micro-batches of an accumulation, the census's FP32 replay, an overflow's attribution replay.
The history is the only state between steps (in the scaler's ``state_dict``).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from lab.core.fp16 import MAX, OVERFLOW_BOUND, UNDERFLOW_BOUND

__all__ = ["PerBlockScaling", "default_boundaries", "block_scales"]

_MIN_EXP, _MAX_EXP = -24, 24  # a block's factor c_l lies in [2^-24, 2^24], amax-history's scale range


def default_boundaries(model: torch.nn.Module) -> list[str]:
    """The blocks of a chain: the children of the model's ``blocks`` list (GPT here, timm's ViT), else timm ResNet's
    ``layer1``..``layer4``. Another model names its own (``boundaries:``)."""
    names = dict(model.named_modules())
    if isinstance(names.get("blocks"), (torch.nn.ModuleList, torch.nn.Sequential)):
        return [f"blocks.{i}" for i in range(len(names["blocks"]))]
    stages = [n for n in ("layer1", "layer2", "layer3", "layer4") if n in names]
    if stages:
        return stages
    raise ValueError("per_tensor: the model has no `blocks` list or layer1..layer4 stages; name its chain's blocks "
                     "(per_tensor: {boundaries: [module names in forward order]})")


def block_scales(maxima: torch.Tensor, scale: float, margin: int) -> torch.Tensor:
    """Per block, the largest power of two c with scale * c * M <= 65504 / 2**margin, clamped to [2^-24, 2^24]
    (amax-history's amax_scale, in tensor ops; FP64 so that the quotient is not rounded across a power of two)."""
    target = MAX / (maxima.double() * scale * 2.0 ** margin)
    _, e = torch.frexp(target)  # target in [2^(e-1), 2^e)
    e = torch.where(torch.isfinite(target), e - 1, torch.full_like(e, _MAX_EXP)).clamp(_MIN_EXP, _MAX_EXP)
    return torch.ldexp(torch.ones_like(maxima, dtype=torch.float32), e)


def observation(amax: torch.Tensor, total_scale: torch.Tensor, margin: int) -> torch.Tensor:
    """What a step says about a block's largest unscaled gradient (amax-history's step_observation, per block):
    ``amax / total_scale``; on an overflow the least maximum that explains it; all zero: the largest value FP16
    would flush."""
    overflow = OVERFLOW_BOUND / (total_scale * 2.0 ** margin)
    seen = torch.where(amax > 0, amax, torch.full_like(amax, UNDERFLOW_BOUND)) / total_scale
    return torch.where(torch.isfinite(amax), seen, overflow)


class _BlockOutput(torch.autograd.Function):
    """Identity forward at block l's output; backward multiplies the gradient by the block's factor r_l."""

    @staticmethod
    def forward(ctx, x, scaling, l):
        ctx.scaling, ctx.l = scaling, l
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.scaling.observe(ctx.l, g)
        return g * ctx.scaling.ratios[ctx.l].to(g.device), None, None


class _ChainInput(torch.autograd.Function):
    """Identity forward at the first block's input; backward divides by c_0: the gradient is back at S."""

    @staticmethod
    def forward(ctx, x, scaling):
        ctx.scaling = scaling
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scaling.cums[0].reciprocal().to(g.device), None


class PerBlockScaling:
    """One model's per-block scales; made by ``LossScaler`` (``per_tensor=``), hooked in by ``attach(model)``."""

    def __init__(self, history: int = 16, margin: int = 3, boundaries: list[str] | None = None,
                 predictor: str | dict = "max"):
        from lab.scaling.predictors import create_predictor
        self.history, self.margin, self.boundaries = history, margin, boundaries
        self.predictor = create_predictor(predictor, history="fp16")
        self.groups: list[list[torch.nn.Parameter]] = []
        self.maxima: torch.Tensor | None = None  # (blocks, history): observations, 0 where none yet
        self.seen = 0  # observations so far (the next one goes to column seen % history)
        self.pending: torch.Tensor | None = None  # this step's largest gradient at each block's output (unscaled)
        self.armed = False  # the backward under way is training's (after the engine's scale()): observe it
        self._disarm_queued = False
        self.scale = 1.0  # the loss scale of the step under way
        self.cums = self.ratios = torch.ones(0)
        self.open = False  # a step is under way: its factors are set
        self.done = False  # its gradients are back at the loss scale
        self._handles: list = []

    # --- installing --------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> "PerBlockScaling":
        """Hook the model's blocks (``boundaries``, or :func:`default_boundaries`) and group their parameters."""
        names = self.boundaries or default_boundaries(model)
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"per_tensor.boundaries: no module {missing[0]!r} in the model")
        blocks = [modules[n] for n in names]
        self.groups = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
        _check_not_shared(model, names, self.groups)
        device = next(model.parameters()).device
        if self.maxima is None or self.maxima.shape[0] != len(blocks):
            self.maxima = torch.zeros(len(blocks), self.history, dtype=torch.float32, device=device)
        self.cums = self.ratios = torch.ones(len(blocks), device=device)
        self.pending = torch.zeros(len(blocks), device=device)
        self._handles = [blocks[0].register_forward_pre_hook(self._enter)]
        for l, params in enumerate(self.groups):  # each backward's own gradient, before .grad sums them
            self._handles += [p.register_hook(lambda g, l=l: self._observe_param(l, g)) for p in params]
        for l, b in enumerate(blocks):
            self._handles.append(b.register_forward_hook(lambda m, a, out, l=l: self._leave(l, out)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _enter(self, module, args):
        if not (args and isinstance(args[0], torch.Tensor)):
            raise TypeError("per_tensor: the first block's first input must be a tensor")
        return (_ChainInput.apply(args[0], self), *args[1:])

    def _leave(self, l: int, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"per_tensor: block {l} returns {type(out).__name__}, not a tensor")
        return _BlockOutput.apply(out, self, l)

    # --- one step ----------------------------------------------------------------------------------------
    def new_step(self, scale: float) -> None:
        """A step starts at loss scale ``scale``: each block's c_l from its history (1 before any observation), and
        the boundary factors r_l = c_l / c_{l+1} (the block above the top one is at S: c = 1)."""
        self.open, self.done, self.scale = True, False, scale
        if self.pending is not None:
            self.pending.zero_()
        if self.seen and self.groups:
            self.cums = block_scales(self._predicted(), scale, self.margin)
            self.ratios = self.cums / torch.cat([self.cums[1:], self.cums.new_ones(1)])

    def _predicted(self) -> torch.Tensor:
        """Each block's predicted maximum: the predictor over its history, most recent first (the ring read in
        order; max, amax-history's rule, gives the same values in any order)."""
        order = (self.seen - 1 - torch.arange(self.history, device=self.maxima.device)) % self.history
        return self.predictor(self.maxima[:, order])

    def observe(self, l: int, g: torch.Tensor) -> None:
        """The gradient reaching block l's output, at S * c_{l+1} (the block above's scale): its unscaled maximum
        joins the step's observation (cast to FP16 at the block's branch outputs, it must fit as the weights' do).
        Only training's backward passes count (armed by the engine's scale(), disarmed when that backward ends):
        the census's FP32 replay and the attribution replay must not change the run."""
        if not self.armed:
            return
        if not self._disarm_queued:
            self._disarm_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._disarm)
        self._note(l, g, self.cums[l] / self.ratios[l])

    def _observe_param(self, l: int, g: torch.Tensor) -> None:
        """A parameter gradient of block l from one backward, at S * c_l (one micro-batch's: what FP16 held)."""
        if self.armed:
            self._note(l, g, self.cums[l])

    def _note(self, l: int, g: torch.Tensor, cum: torch.Tensor) -> None:
        seen = observation(g.detach().abs().amax().float(), cum * self.scale, self.margin)
        torch.maximum(self.pending[l], seen.to(self.pending.device), out=self.pending[l])

    def _disarm(self) -> None:
        self.armed, self._disarm_queued = False, False

    def to_loss_scale(self, scale: float) -> None:
        """Divide each block's parameter gradients by c_l (exact): every gradient is then at the loss scale, which
        the engine unscales and checks as always; the step's observations join the history. Once a step, before
        clipping. (Observed per backward, not here: .grad sums a step's backward passes, and an emulated
        accumulation multiplies it, while FP16 held each backward's part.)"""
        if self.done or not self.groups:
            return
        self.done = True
        with torch.no_grad():
            for params, cum in zip(self.groups, self.cums):
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, cum.reciprocal().to(grads[0].device))
            self.maxima[:, self.seen % self.history] = self.pending
        self.seen += 1

    def end_step(self) -> None:
        self.open = False

    def state_dict(self) -> dict[str, Any]:
        return {"maxima": [] if self.maxima is None else self.maxima.tolist(), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])
        if state["maxima"]:
            device = self.maxima.device if self.maxima is not None else "cpu"
            self.maxima = torch.tensor(state["maxima"], dtype=torch.float32, device=device)


def _check_not_shared(model: torch.nn.Module, names: Iterable[str], groups: list[list[torch.nn.Parameter]]) -> None:
    """A parameter used inside a block and outside it (or in two blocks) would get gradients at two scales."""
    owner: dict[int, str] = {}
    prefixes = tuple(f"{n}." for n in names)
    for l, params in enumerate(groups):
        for p in params:
            if id(p) in owner:
                raise ValueError(f"per_tensor: a parameter is shared by blocks {owner[id(p)]} and {l}")
            owner[id(p)] = str(l)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(prefixes):
            raise ValueError(f"per_tensor: parameter {name!r} is also used outside the blocks (tied): its "
                             "gradients would carry two scales; leave its block out of the boundaries")

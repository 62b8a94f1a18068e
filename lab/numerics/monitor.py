"""The training loop's view of gradient numerics: a census every few steps, attribution on overflow steps.

``NumericsMonitor`` counts a model's activation and parameter gradients with ``lab.numerics.census`` (census.csv,
grad_hist.csv) and, on a step the loss scaler skipped for overflow, names the layer whose gradient was the
first non-finite one in backward order (steps.csv ``first_nonfinite_layer``, ``first_nonfinite_source``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import weakref
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from lab.core.fp16 import MAX as FP16_MAX  # 65504 (torch.finfo): an output beyond it cannot be held in FP16
from lab.core.fp16 import amaxes
from lab.core.shards import local_shard
from lab.numerics.adapters import is_adapter
from lab.numerics.census import (CENSUS_COLUMNS, COUNTERFACTUAL_SCALES, HIST_COLUMNS, HIST_RANGE, TOTAL, Tally,
                                 TallyResult, _check_scale, replay_rows)

__all__ = ["NumericsMonitor", "ACTIVATION", "PARAM", "ADAPTER", "REPLAY_LIMIT"]

log = logging.getLogger("lab.numerics.monitor")

ACTIVATION, PARAM = "activation_grad", "param_grad"  # census.csv sources; also where a step's inf was first
ADAPTER = "adapter_grad"  # census.csv source of LoRA adapters' parameter gradients (a base model's stay param_grad)
#: default overflow steps per run replayed for exact attribution (the study's: train.attribution_replays)
REPLAY_LIMIT = 32

_no_torch_function = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _rng_state() -> tuple:
    """The generators a forward pass can draw from (dropout, drop-path): CPU, and CUDA once initialised."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class NumericsMonitor:
    """Gradient census and overflow attribution for one model in a training loop.

    Every ``every`` optimizer steps (step % every == 0, a *census step*) it counts
      * activation gradients: the gradient reaching each leaf module's output tensors, captured by forward
        hooks that hook each output's autograd node (what ``output.register_hook`` does; full backward
        hooks break on timm's in-place activations, field notes section 5);
      * parameter gradients after backward, before ``unscale_`` (grads of the scaled loss), per owning module
        (parameters the root module owns directly are reported under their own name).
    Reduced-precision steps are classified as they are (at_scale = the loss scale in use); FP32 steps
    counterfactually at ``scales`` (what FP16 would make of these gradients at those loss scales). Log2
    histograms of all of a step's activation / parameter gradients (FP32 runs: unscaled values, at_scale 1)
    go to grad_hist.csv. The hooks exist during census steps only: other steps run the bare model.

    A module whose output is the very tensor another module produced (nn.Identity, Dropout(p=0)) gets a row
    equal to that tensor's counts, without counting it again, and is left out of ``__total__``; an output
    that is a view of another (ViT's q_norm and k_norm act on slices of qkv's output) is a tensor of its own
    and is counted in both rows and in ``__total__``.

    Overflow attribution (``attribute``, for runs with a loss scaler). On a step the scaler skipped for
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
    (one fused max-abs pass per step: up to ~5% of a CPU step, benchmarks/bench_attribution.py), and an
    overflow step names the module whose parameter gradient was the first non-finite one in the backward
    order recorded on census steps (source ``param_grad``). A replay that finds nothing non-finite (a
    nondeterministic kernel) leaves the step unattributed ("").

    Calls, per optimizer step: ``begin_step`` before the first forward, ``after_backward`` before unscale_,
    ``end_step`` after the scaler's update and before zero_grad; ``finish(run_dir)`` at the end.
    """

    def __init__(self, model: torch.nn.Module, every: int, *, attribute: bool = False,
                 scales: Sequence[float] = COUNTERFACTUAL_SCALES, hist: tuple[int, int] = HIST_RANGE,
                 replay_limit: int = REPLAY_LIMIT, fp32_replay: bool = False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"census_every must be an int >= 0, got {every!r}")
        self.model = model
        self.every = every
        self.enabled = every > 0
        self.attribute = attribute and self.enabled
        self.scales = tuple(_check_scale(s) for s in scales)
        self.hist = hist
        self.replay_limit = replay_limit
        self.fp32_replay = fp32_replay
        self.fp32_replays = 0  # census steps replayed in FP32 (census rows with grads "fp32" in an FP16 run)
        self.census_rows: list[dict] = []
        self.hist_rows: list[dict] = []
        self.first_overflow_step: int | None = None
        self.first_nonfinite_layer: str | None = None
        self.census_steps = 0
        self.replays = 0
        self.last_source = ""  # where end_step's answer came from: ACTIVATION, PARAM or ""
        # a replay's first module beyond FP16's range: (name, class, max |output|, max |own weights|)
        self.last_forward: tuple[str, str, float, float] | None = None
        self.owners: list[tuple[str, list[torch.nn.Parameter]]] = []
        self.leaves: list[tuple[str, torch.nn.Module]] = []
        self.backward_rank: dict[str, int] = {}  # owner -> when backward completed its grads (census steps)
        self._handles: list = []
        self._step, self._scale, self._precision = 0, 1.0, "fp32"
        self._step_rng: tuple | None = None
        self._labels: dict[float, float] = {}
        self._hist_label = 1.0
        self._reset_step()
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if own:
                if name:
                    self.owners.append((name, own))
                else:  # the root's own parameters (ViT cls_token, pos_embed): one row each
                    self.owners += [(pname, [p]) for pname, p in module.named_parameters(recurse=False)
                                    if p.requires_grad]
            if next(module.children(), None) is None:
                self.leaves.append((name or "__root__", module))

    @property
    def leaf_names(self) -> list[str]:
        return [name for name, _ in self.leaves]

    def _reset_step(self) -> None:
        self._census_now = False
        self._recorded = False                       # this census step's rows are already written
        self._grads = "fp32"                         # census.csv `grads`: the precision of the values counted
        self._regs: list[str] = []                   # hooked output tensors of this step -> their module
        self._rid_of: dict[tuple[int, int], int] = {}  # (id(autograd node), output_nr) -> index in _regs
        self._keep: list = []                        # those nodes, alive so that their ids stay unique
        self._aliases: list[tuple[str, int]] = []    # (module, index of the tensor it passed on)
        self._tally: Tally | None = None
        self._grad_order: dict[str, int] = {}
        self._flags: tuple[list[str], torch.Tensor] | None = None  # finite flags of the step's param grads
        self.grad_amaxes: torch.Tensor | None = None  # their maxima (scaled), when the flags were taken

    # --- hooks (census steps only) ----------------------------------------------------------------------
    def _install(self) -> None:
        ref = weakref.ref(self)  # the model must not keep a finished monitor alive
        for name, module in self.leaves:
            self._handles.append(module.register_forward_hook(functools.partial(_forward_hook, ref, name)))
        for layer, params in self.owners:
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_done_hook, ref, layer)))

    def _uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _watch(self, name: str, t: torch.Tensor) -> None:
        node = t.grad_fn
        key = (id(node), t.output_nr) if node is not None else (id(t), -1)
        rid = self._rid_of.get(key)
        if rid is not None:  # the very tensor an earlier module produced: its row repeats that one's counts
            self._aliases.append((name, rid))
            return
        rid = self._rid_of[key] = len(self._regs)
        self._regs.append(name)
        self._keep.append(node if node is not None else t)
        _on_gradient(t, functools.partial(self._on_grad, rid))

    def _on_grad(self, rid: int, grad: torch.Tensor | None) -> None:
        # runs inside backward, where grad mode is off (the engine's default without create_graph)
        if grad is not None and self._census_now:
            self._tally.add(rid, grad)

    # --- the loop's calls -------------------------------------------------------------------------------
    def begin_step(self, step: int, scale: float, precision: str) -> None:
        """Start optimizer step ``step`` (loss scale ``scale``, active precision); hooks on census steps."""
        if not self.enabled:
            return
        self._uninstall()  # a step left unfinished (an epoch ending mid-accumulation)
        self._reset_step()
        self._step, self._scale, self._precision, self._grads = step, float(scale), precision, precision
        self._census_now = step % self.every == 0
        if (self.attribute and self.replays < self.replay_limit) or self.wants_fp32_replay():
            self._step_rng = _rng_state()  # a replay must draw the same dropout masks as the step
        if self._census_now:
            if precision == "fp32":  # counterfactual: what FP16 would make of these grads at each scale
                self._labels = {s: s for s in self.scales}
                self._hist_label = 1.0
            else:  # as they are; they already carry the loss scale
                self._labels = {1.0: self._scale}
                self._hist_label = self._scale
            self._tally = Tally(scales=tuple(self._labels), hist=self.hist)
            self._install()

    def set_scale(self, scale: float) -> None:
        """The loss scale this step really used, when it changed after ``begin_step`` (a scale set by hand between
        steps: lab/run/record.py): the census rows of an FP16 step are labelled with it."""
        self._scale = float(scale)
        if self._census_now and self._precision != "fp32":
            self._labels = {1.0: self._scale}
            self._hist_label = self._scale

    def after_backward(self) -> None:
        """Count the parameter gradients (call after the step's last backward, before unscale_)."""
        if self.attribute and self.replays >= self.replay_limit:
            # no replay left: flag the gradients now, before unscale_ and clipping rewrite them (a clip
            # coefficient of max_norm/inf makes every gradient NaN on an overflow step)
            self._flags = self._grad_flags()
        if not self._census_now:
            return
        self._uninstall()
        self._tally_param_grads()

    def _tally_param_grads(self) -> None:
        """Count every owner's parameter gradients into this step's tally."""
        with torch.no_grad():
            for layer, params in self.owners:
                # a sharded (FSDP2) gradient: this rank's shard
                grads = [local_shard(p.grad) for p in params if p.grad is not None]
                if grads:
                    self._tally.add((ADAPTER if is_adapter(layer) else PARAM, layer), grads)

    @contextlib.contextmanager
    def _untouched(self, keep_grads: bool):
        """Run a replay of this step with nothing training depends on changed: the step's generator state
        for it (the same dropout draws), the buffers (BatchNorm statistics) and the generators restored after,
        and the parameter gradients either restored (``keep_grads``: the step still needs them) or left None
        (a skipped step's, which zero_grad discards anyway: not held twice)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad for p in params] if keep_grads else [None] * len(params)
        buffers = [b.detach().clone() for b in self.model.buffers()]
        rng = _rng_state()
        try:
            _set_rng_state(self._step_rng)
            for p in params:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers):
                    b.copy_(saved)
            for p, g in zip(params, grads):
                p.grad = g
            _set_rng_state(rng)

    def wants_fp32_replay(self) -> bool:
        """A census step of an FP16 run with ``fp32_replay``: the loop calls :meth:`census_fp32_replay` after
        ``after_backward``. (An FP32 run's census is already counterfactual; bf16 keeps FP32's range.)"""
        return self._census_now and self.fp32_replay and self._precision == "fp16"

    def census_fp32_replay(self, replay: Callable[[], None]) -> None:
        """Count what FP16 lost on this census step: ``replay`` runs the step's forward and scaled backward again
        in FP32 (same micro-batches, same loss scale, same dropout draws), and its gradients are counted as FP16
        at the scale in use would hold them (census.csv rows with ``grads`` "fp32", next to the step's own FP16
        rows): an FP16 zero is either a true zero or a flushed value, and only the FP32 values tell which.

        Call after ``after_backward`` and before unscale_. Nothing training depends on changes: the step's
        gradients, the buffers (BatchNorm statistics) and the generator states are restored, so the run's
        trajectory is bit-identical with or without it (tested). Cost: one FP32 forward and backward per
        census step (benchmarks/bench_census.py)."""
        self._uninstall()
        self._record_census()  # the step's own FP16 rows first, from its own hooks
        self._recorded = True
        labels, hist_label = self._labels, self._hist_label
        self._regs, self._rid_of, self._keep, self._aliases = [], {}, [], []
        self._tally = Tally(scales=(1.0,), hist=self.hist)  # FP32 values of the scaled loss, classified as is
        self._labels, self._hist_label, self._grads = {1.0: self._scale}, self._scale, "fp32"
        try:
            with self._untouched(keep_grads=True):
                self._install()
                replay()
                self._uninstall()
                self._tally_param_grads()
            self._record_census(count=False)
            self.fp32_replays += 1
        finally:
            self._uninstall()
            self._labels, self._hist_label, self._grads = labels, hist_label, self._precision

    def end_step(self, found_inf: bool, replay: Callable[[], None] | None = None) -> str:
        """Close the step; on an overflow step return the first non-finite layer ("" otherwise).

        ``replay``: on a skipped overflow step, a function that runs the step's forward and scaled backward
        again on the same micro-batches (see the class docstring); None where the step changed the
        parameters. Call before ``optimizer.zero_grad`` (after a replay the gradients are None).
        """
        self.last_source, self.last_forward = "", None
        if not self.enabled:
            return ""
        layer = ""
        try:
            self._uninstall()
            if self._census_now:
                if self._grad_order:
                    self.backward_rank = dict(self._grad_order)
                if not self._recorded:
                    self._record_census()
            if found_inf and self.attribute:
                if replay is not None and self._step_rng is not None and self.replays < self.replay_limit:
                    self.replays += 1
                    try:
                        layer, self.last_source = self._replay(replay)
                    except torch.OutOfMemoryError as e:  # attribution must not end the run
                        log.warning("overflow attribution: replay of step %d ran out of memory (%s); "
                                    "parameter-gradient flags from the next step on", self._step, e)
                        self.replay_limit = self.replays
                if not layer:
                    layer = self._attribute(self._flags)
                    self.last_source = PARAM if layer else ""
                if self.first_overflow_step is None:
                    self.first_overflow_step, self.first_nonfinite_layer = self._step, layer
        finally:
            self._reset_step()
            self._step_rng = None
        return layer

    def _replay(self, replay: Callable[[], None]) -> tuple[str, str]:
        """Run ``replay`` with a finiteness flag on every gradient; the first non-finite (layer, source). The same
        replay measures the forward range: each module's largest output magnitude, in the order the modules
        finish their forward, and of its own weights (``last_forward``: the first one beyond FP16's range, or None).
        One host read for all of it."""
        flags: list[tuple[str, str, torch.Tensor]] = []  # in the order backward computes them
        outputs: list[tuple[str, str, torch.Tensor]] = []  # (module, its class, max |output|), forward order
        weights: list[torch.Tensor] = []  # max |w| over each such module's own parameters (0: none)

        def flag(layer: str, source: str, g: torch.Tensor | None) -> None:
            if g is not None:
                flags.append((layer, source, torch.isfinite(g).all()))

        def forward_hook(name, module, args, output):
            _each_grad_output(output, lambda t: _on_gradient(t, functools.partial(flag, name, ACTIVATION)))

        def range_hook(name, module, args, output):
            amax = _output_amax(output)
            if amax is not None:
                outputs.append((name, type(module).__name__, amax))
                weights.append(_output_amax(list(module.parameters(recurse=False))) if next(
                    module.parameters(recurse=False), None) is not None else torch.zeros((), device=amax.device))

        handles = [m.register_forward_hook(functools.partial(forward_hook, name)) for name, m in self.leaves]
        handles += [m.register_forward_hook(functools.partial(range_hook, name or "__root__"))
                    for name, m in self.model.named_modules()]
        handles += [p.register_post_accumulate_grad_hook(lambda p, layer=layer: flag(layer, PARAM, p.grad))
                    for layer, ps in self.owners for p in ps]
        try:
            with self._untouched(keep_grads=False):
                replay()
                n, m = len(flags), len(outputs)
                every = [f.float() for _, _, f in flags] + [a for _, _, a in outputs] + weights
                values = torch.stack([v.to(every[0].device) for v in every]).tolist() if every else []  # one sync
        finally:
            for h in handles:
                h.remove()
        self.last_forward = next(((name, kind, amax, w) for (name, kind, _), amax, w in
                                  zip(outputs, values[n:n + m], values[n + m:])
                                  if not amax <= FP16_MAX), None)  # beyond 65504, inf or NaN
        for (layer, source, _), ok in zip(flags, values[:n]):
            if not ok:
                return layer, source
        return "", ""

    def _grad_flags(self) -> tuple[list[str], torch.Tensor] | None:
        """Per parameter gradient of the scaled loss: is it finite? (owner of each, a device tensor; no sync).
        Keeps the gradients' maxima in ``grad_amaxes`` (the scaled values; a recorder reuses them)."""
        layers, grads = [], []
        for layer, params in self.owners:
            for p in params:
                if p.grad is not None:
                    layers.append(layer)
                    grads.append(local_shard(p.grad))  # FSDP2: this rank's shard
        if not grads:
            return None
        # the max-abs of each is inf/nan exactly when the tensor holds one (lab.core.fp16.amaxes: one pass each)
        self.grad_amaxes = amaxes(grads)
        return layers, torch.isfinite(self.grad_amaxes)

    def _attribute(self, flags: tuple[list[str], torch.Tensor] | None) -> str:
        """The owner of the first non-finite parameter gradient in backward order ("" if none is)."""
        if flags is None:
            return ""
        layers, finite = flags
        bad = {layer for layer, ok in zip(layers, finite.tolist()) if not ok}  # the one host sync
        if not bad:
            return ""
        # backward order as recorded; owners it never saw (none, normally) by reverse definition order
        defined = {layer: i for i, (layer, _) in enumerate(self.owners)}
        return min(bad, key=lambda layer: (self.backward_rank.get(layer, math.inf), -defined[layer]))

    def _record_census(self, count: bool = True) -> None:
        results = self._tally.result()  # the census step's one host sync
        self.census_steps += int(count)
        act: dict[str, TallyResult] = {}
        act_total = None
        for rid, layer in enumerate(self._regs):
            r = results.get(rid)
            if r is not None:
                act[layer] = act[layer] + r if layer in act else r
                act_total = r if act_total is None else act_total + r
        for layer, rid in self._aliases:
            r = results.get(rid)
            if r is not None:
                act[layer] = act[layer] + r if layer in act else r
        par = {key[1]: r for key, r in results.items() if isinstance(key, tuple) and key[0] == PARAM}
        ada = {key[1]: r for key, r in results.items() if isinstance(key, tuple) and key[0] == ADAPTER}
        par_total, ada_total = _sum(par.values()), _sum(ada.values())
        order = {n: i for i, (n, _) in enumerate(self.leaves)}
        order_p = {n: i for i, (n, _) in enumerate(self.owners)}
        for source, rows, total, rank in ((ACTIVATION, act, act_total, order), (PARAM, par, par_total, order_p),
                                          (ADAPTER, ada, ada_total, order_p)):
            if total is None:
                continue
            layers = sorted(rows, key=lambda n: rank.get(n, len(rank)))
            for s, label in self._labels.items():
                for layer, r in [*((n, rows[n]) for n in layers), (TOTAL, total)]:
                    self.census_rows.append({"step": self._step, "scale": self._scale, "source": source,
                                             "layer": layer, "at_scale": label, **r.census(s).as_dict(),
                                             "grads": self._grads})
            for b, n in total.hist().as_dict().items():
                self.hist_rows.append({"step": self._step, "source": source, "at_scale": self._hist_label,
                                       "log2_bin": b, "count": n, "grads": self._grads})

    def finish(self, run_dir: str | Path | None = None) -> dict:
        """Remove any hooks, write census.csv and grad_hist.csv (atomically; header only when the census is
        off, so a run's set of files never depends on its settings); return metrics."""
        self.close()
        if run_dir is not None:
            from lab.core import files
            files.atomic_write_csv(Path(run_dir) / "census.csv", self.census_rows, CENSUS_COLUMNS)
            files.atomic_write_csv(Path(run_dir) / "grad_hist.csv", self.hist_rows, HIST_COLUMNS)
        return {"census_every": self.every, "census_steps": self.census_steps, **self.flush_shares(),
                "first_overflow_step": self.first_overflow_step, "first_nonfinite_layer": self.first_nonfinite_layer,
                "attribution_replays": self.replays, "census_fp32_replays": self.fp32_replays}

    def flush_shares(self) -> dict:
        """What FP16 loses, over every census step: of the gradient values FP32 holds non-zero, the share FP16
        flushes to zero and the share it keeps only as subnormals (under 11 significant bits), per source.
        An FP16 run: its FP32 replays, at the scale it used; an FP32 run: its counterfactual at scale 1 (FP16
        without a loss scale); None for other runs (bf16, or FP16 without the replay)."""
        reduced = {r.get("grads", "fp32") for r in self.census_rows} - {"fp32"}  # {"fp16"}; {} in an FP32 run
        if reduced:  # an FP16 run: its replayed steps (a bf16 run has none)
            rows = replay_rows(self.census_rows) if reduced == {"fp16"} else []
        else:  # an FP32 run: its counterfactual at scale 1
            rows = [r for r in self.census_rows if r["at_scale"] == 1.0]
        out = {}
        for source, key in ((ACTIVATION, "activation"), (PARAM, "param"), (ADAPTER, "adapter")):
            mine = [r for r in rows if r["layer"] == TOTAL and r["source"] == source]
            if source == ADAPTER and not mine:
                continue  # no adapters: no adapter keys (the metrics of every other run stay as they were)
            nonzero = sum(r["total"] - r["zero"] for r in mine)
            out[f"flushed_{key}"] = sum(r["underflow"] for r in mine) / nonzero if nonzero else None
            out[f"subnormal_{key}"] = sum(r["subnormal"] for r in mine) / nonzero if nonzero else None
        return out

    def close(self) -> None:
        self._uninstall()
        self._reset_step()

    # what a checkpoint keeps between optimizer steps (lab/run/checkpoint.py): everything finish() reports
    _STATE = ("census_rows", "hist_rows", "first_overflow_step", "first_nonfinite_layer", "census_steps",
              "replays", "replay_limit", "backward_rank", "fp32_replays")

    def state_dict(self) -> dict:
        return {k: copy.deepcopy(getattr(self, k)) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            setattr(self, k, copy.deepcopy(state.get(k, getattr(self, k))))  # fp32_replays: newer than some


def _on_gradient(t: torch.Tensor, fn: Callable[[torch.Tensor | None], None]) -> None:
    """Call ``fn(grad of t)`` when backward computes it: what ``t.register_hook`` does, without its Python
    overhead for a non-leaf, and tied to the autograd node that produced t (so a later in-place op on t,
    timm's in-place activations, does not move it)."""
    node = t.grad_fn
    if node is None:
        t.register_hook(fn)
    else:
        nr = t.output_nr
        node.register_prehook(lambda grad_outputs: fn(grad_outputs[nr]))


def _each_grad_output(output, fn: Callable[[torch.Tensor], None]) -> None:
    """``fn(t)`` for each tensor of a module's output that takes part in backward."""
    with _no_torch_function():  # skip lab.numerics.contract's TorchFunctionMode on these tensor accesses
        for t in _tensors(output):
            if t.requires_grad:
                fn(t)


def _output_amax(output) -> torch.Tensor | None:
    """The largest magnitude among a module's floating-point outputs, as an FP32 scalar on their device (NaN when one
    holds a NaN); None without one."""
    with _no_torch_function(), torch.no_grad():
        found = [t.detach().abs().amax().float() for t in _tensors(output) if t.is_floating_point() and t.numel()]
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).amax()


def _sum(results):
    total = None
    for r in results:
        total = r if total is None else total + r
    return total


def _forward_hook(ref, name: str, module, args, output) -> None:
    mon = ref()
    if mon is not None and mon._census_now:
        _each_grad_output(output, functools.partial(mon._watch, name))


def _grad_done_hook(ref, layer: str, param) -> None:
    mon = ref()
    if mon is not None and layer not in mon._grad_order:
        mon._grad_order[layer] = len(mon._grad_order)

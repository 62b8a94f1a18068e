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
import weakref
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from lab.core.shards import local_shard
from lab.numerics.adapters import is_adapter
from lab.numerics.census import (CENSUS_COLUMNS, COUNTERFACTUAL_SCALES, HIST_COLUMNS, HIST_RANGE, TOTAL, Tally,
                                 TallyResult, _check_scale, replay_rows)
from lab.numerics import attribution
from lab.numerics.attribution import ACTIVATION, PARAM  # census.csv sources; where a step's inf was first
from lab.numerics.micro import BackwardCounter, for_each_grad_output, on_gradient, rng_state, set_rng_state

__all__ = ["NumericsMonitor", "ACTIVATION", "PARAM", "ADAPTER", "REPLAY_LIMIT"]

log = logging.getLogger("lab.numerics.monitor")

ADAPTER = "adapter_grad"  # census.csv source of LoRA adapters' parameter gradients (a base model's stay param_grad)
#: default overflow steps per run replayed for exact attribution (the study's: train.attribution_replays)
REPLAY_LIMIT = 32

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

    Overflow attribution (``attribute``, for runs with a loss scaler): on a skipped overflow step, a replay with a
    finiteness flag on every gradient names the first non-finite layer and source; without one, the parameter
    gradients' flags before unscale_ (lab/numerics/attribution.py says how, and what it costs).

    Per micro-batch (``micro``, a BackwardCounter: lab.record): each backward pass of a census step is counted apart
    (parameter gradients as each backward delivers them), so that an FP32 replay of the step's last k micro-batches
    is compared with their own FP16 counts (lab/numerics/micro.py).

    Calls, per optimizer step: ``begin_step`` before the first forward, ``after_backward`` before unscale_,
    ``end_step`` after the scaler's update and before zero_grad; ``finish(run_dir)`` at the end.
    """

    def __init__(self, model: torch.nn.Module, every: int, *, attribute: bool = False,
                 scales: Sequence[float] = COUNTERFACTUAL_SCALES, hist: tuple[int, int] = HIST_RANGE,
                 replay_limit: int = REPLAY_LIMIT, fp32_replay: bool = False,
                 micro: BackwardCounter | None = None):
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
        # per micro-batch (lab.record): each backward pass of a census step counted on its own, so that a replay of
        # the step's last micro-batch(es) meets their own FP16 counts (lab/numerics/micro.py)
        self.micro = micro
        self.replayed_micro = 1  # how many micro-batches the last FP32 replay ran (the next replay's guess)
        self.mismatched_replays = 0  # FP32 replays that ran more backward passes than their step had
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
        owned: set[int] = set()  # a tied weight (GPT-2's head and embedding) is counted once, under its first owner
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in owned]
            owned.update(id(p) for p in own)
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
        self._tallies: dict[int, Tally] = {}         # per micro-batch (``micro``): backward pass -> its tally
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
                if self.micro is not None:  # each backward's contribution, counted in its micro-batch
                    self._handles.append(p.register_hook(functools.partial(_param_grad_hook, ref, layer)))

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
        on_gradient(t, functools.partial(self._on_grad, rid))

    def _on_grad(self, rid: int, grad: torch.Tensor | None) -> None:
        # runs inside backward, where grad mode is off (the engine's default without create_graph)
        if grad is not None and self._census_now:
            self._tally_now().add(rid, grad)

    def _tally_now(self) -> Tally:
        """The tally of the backward pass now running: the step's one tally, or that micro-batch's own."""
        if self.micro is None:
            return self._tally
        i = self.micro.current()
        if i not in self._tallies:
            self._tallies[i] = Tally(scales=tuple(self._labels), hist=self.hist)
        return self._tallies[i]

    def _on_param_grad(self, layer: str, grad: torch.Tensor | None) -> None:
        """Per micro-batch: a parameter's gradient from this backward pass, before it is added to ``.grad``."""
        if grad is not None and self._census_now:
            self._tally_now().add((ADAPTER if is_adapter(layer) else PARAM, layer), local_shard(grad))

    def _results(self, micro: Iterable[int] | None = None) -> dict:
        """This step's counts by key: the one tally's, or the sum over micro-batches ``micro`` (all by default)."""
        if self.micro is None:
            return self._tally.result()
        out: dict = {}
        for i in sorted(self._tallies) if micro is None else micro:
            for key, r in (self._tallies[i].result() if i in self._tallies else {}).items():
                out[key] = out[key] + r if key in out else r
        return out

    # --- the loop's calls -------------------------------------------------------------------------------
    def begin_step(self, step: int, scale: float, precision: str) -> None:
        """Start optimizer step ``step`` (loss scale ``scale``, active precision); hooks on census steps."""
        if not self.enabled:
            return
        self._uninstall()  # a step left unfinished (an epoch ending mid-accumulation)
        self._reset_step()
        self._step, self._scale, self._precision, self._grads = step, float(scale), precision, precision
        self._census_now = step % self.every == 0
        replays = (self.attribute and self.replays < self.replay_limit) or self.wants_fp32_replay()
        if replays:
            self._step_rng = rng_state()  # a replay must draw the same dropout masks as the step
        if self.micro is not None:  # per micro-batch: the state at each one's first forward
            self.micro.keep_rng = replays
        if self._census_now:
            if precision == "fp32":  # counterfactual: what FP16 would make of these grads at each scale
                self._labels = {s: s for s in self.scales}
                self._hist_label = 1.0
            else:  # as they are; they already carry the loss scale
                self._labels = {1.0: self._scale}
                self._hist_label = self._scale
            self._tally = Tally(scales=tuple(self._labels), hist=self.hist) if self.micro is None else None
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
        if self.micro is None:  # per micro-batch, the hooks counted each backward's parameter gradients
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
        rng, start = rng_state(), self._replay_rng()
        try:
            set_rng_state(start)
            for p in params:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers):
                    b.copy_(saved)
            for p, g in zip(params, grads):
                p.grad = g
            set_rng_state(rng)

    def _replay_rng(self) -> tuple:
        """The generator state a replay starts from: the step's, or per micro-batch that of the first micro-batch
        the replay is expected to run (the last one, or as many as the last replay ran)."""
        if self.micro is not None:
            state = self.micro.rng_at(max(self.micro.count - self.replayed_micro, 0))
            if state is not None:
                return state
        return self._step_rng

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
        census step (benchmarks/speed/bench_census.py)."""
        self._uninstall()
        if self.micro is not None:
            self._census_micro_replay(replay)
            return
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

    def _census_micro_replay(self, replay: Callable[[], None]) -> None:
        """census_fp32_replay per micro-batch: the replay's k backward passes (k = 1: the step's last micro-batch,
        as a recorded loop's replay runs it; k = the step's count: all of them) are counted against the FP16 counts
        of the step's last k micro-batches, so both sides count the same values. A replay that runs more backward
        passes than the step had (or none) cannot be matched: the step keeps its own rows only, with a warning."""
        n = self.micro.count
        own = (self._regs, self._rid_of, self._keep, self._aliases, self._tallies)
        labels, hist_label = self._labels, self._hist_label
        self._regs, self._rid_of, self._keep, self._aliases, self._tallies = [], {}, [], [], {}
        self._labels, self._hist_label, self._grads = {1.0: self._scale}, self._scale, "fp32"
        try:
            with self._untouched(keep_grads=True), self.micro.apart() as ran:
                self._install()
                replay()
                self._uninstall()
            k = ran[0]
            replayed, replay_maps = self._results(), (self._regs, self._aliases)
        finally:
            self._uninstall()
            self._regs, self._rid_of, self._keep, self._aliases, self._tallies = own
            self._labels, self._hist_label, self._grads = labels, hist_label, self._precision
        if not 0 < k <= n:
            self.mismatched_replays += 1
            log.warning("census step %d: the FP32 replay ran %d backward passes, the step %d: not compared (a replay "
                        "runs the step's last micro-batch, or all of them)", self._step, k, n)
            return
        self.replayed_micro = k
        self._record_census(results=self._results(range(n - k, n)))  # the replayed micro-batches' FP16 counts
        self._recorded = True
        self._regs, self._aliases = replay_maps
        self._labels, self._hist_label, self._grads = {1.0: self._scale}, self._scale, "fp32"
        try:
            self._record_census(count=False, results=replayed)
            self.fp32_replays += 1
        finally:
            self._regs, self._rid_of, self._keep, self._aliases, self._tallies = own
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
        """Run ``replay`` with a finiteness flag on every gradient and the forward range measured (attribution.py);
        its first non-finite (layer, source), and ``last_forward``."""
        # a replay's backward passes are not the step's micro-batches
        with self._untouched(keep_grads=False), self.micro.apart() if self.micro else contextlib.nullcontext():
            layer, source, self.last_forward = attribution.flagged_replay(self.model, self.leaves, self.owners, replay)
        return layer, source

    def _grad_flags(self) -> tuple[list[str], torch.Tensor] | None:
        """Per parameter gradient of the scaled loss: is it finite? Keeps their maxima in ``grad_amaxes``."""
        flags = attribution.grad_flags(self.owners)
        if flags is None:
            return None
        layers, self.grad_amaxes = flags
        return layers, torch.isfinite(self.grad_amaxes)

    def _attribute(self, flags: tuple[list[str], torch.Tensor] | None) -> str:
        return attribution.first_nonfinite_owner(flags, self.owners, self.backward_rank)

    def _record_census(self, count: bool = True, results: dict | None = None) -> None:
        results = self._results() if results is None else results  # the census step's one host sync per tally
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


def _sum(results):
    total = None
    for r in results:
        total = r if total is None else total + r
    return total


def _forward_hook(ref, name: str, module, args, output) -> None:
    mon = ref()
    if mon is not None and mon._census_now:
        for_each_grad_output(output, functools.partial(mon._watch, name))


def _param_grad_hook(ref, layer: str, grad) -> None:
    mon = ref()
    if mon is not None:
        mon._on_param_grad(layer, grad)


def _grad_done_hook(ref, layer: str, param) -> None:
    mon = ref()
    if mon is not None and layer not in mon._grad_order:
        mon._grad_order[layer] = len(mon._grad_order)

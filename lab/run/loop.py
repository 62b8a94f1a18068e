"""The training loop of one run: epochs, micro-batches, the scaled optimizer step, logging and checkpoints.

lab/run/train.py builds the run's components (or restores them from a checkpoint) and hands them to
:class:`EpochLoop`; what the loop leaves in its :class:`~lab.run.rundir.LoopState` becomes the run's metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import signal
import time
from pathlib import Path

import torch

from lab.core import files
from lab.core.errors import ConfigError
from lab.core.shards import local_shard, whole
from lab.models.lora import widened_to_fp32
from lab.run import checkpoint, outcomes
from lab.numerics.precision import autocast_for
from lab.run.evaluation import evaluate, evaluate_sharded, evaluation_precision
from lab.run.memory import StepMemory
from lab.run.rundir import LoopState, StepLog, forward_columns, save_checkpoint
from lab.scaling.policies.deepspeed import ScaleFloorReached
from lab.scaling.engine import grads_amax

log = logging.getLogger("lab.run.train")


def forward_backward(model, loss_fn, x, y, precision: str, device: str, divisor: int, scale,
                     planter=None) -> torch.Tensor:
    """One micro-batch: forward under the precision's autocast, loss / divisor, backward of scale(loss).
    ``divisor`` is accum_steps x emulated_accum (see EpochLoop.divisor); ``planter`` (lab/run/faults.py), armed
    for this micro-batch, plants its faults."""
    with autocast_for(precision, device):
        loss = loss_fn(model(x), y) / divisor
        if planter is not None:
            loss = planter.plant_loss(loss)
    scale(loss).backward()
    return loss


def replay_step(model, loss_fn, batches, scale: float, precision: str, device: str, divisor: int,
                planter=None, step: int = 0) -> None:
    """Forward and scaled backward of one optimizer step's micro-batches, as the loop ran them (the loss
    times the scale as an FP32 tensor, as LossScaler.scale multiplies it; planted faults planted again)."""
    def times_scale(loss):
        return loss * torch.full((), scale, dtype=torch.float32, device=loss.device)
    for micro, (x, y) in enumerate(batches):
        if planter is not None:
            planter.arm(step, micro)
        forward_backward(model, loss_fn, x, y, precision, device, divisor, times_scale, planter)
    if planter is not None:
        planter.disarm()


@dataclasses.dataclass
class EpochLoop:
    """Trains from ``state`` to ``total_steps`` (or divergence), writing steps.csv rows through ``steps_log``.

    ``components`` are the checkpointed objects (model, optimizer, schedule, scaler, monitor and, when the
    config plants faults, faults); ``trained`` is what forward and backward run through (DDP's wrapper when
    distributed), ``d`` this process's place among the processes (lab/run/distributed.py), ``write_dir`` where
    this process writes, ``signals`` the SIGTERM/SIGUSR1 flag that asks for a checkpoint and a stop."""
    cfg: object
    write_dir: Path
    device: str
    progress: object
    train_loader: object
    val_loader: object
    components: dict
    state: LoopState
    steps_log: StepLog
    signals: checkpoint.SignalFlag
    loss_fn: object
    params: list
    steps_per_epoch: int
    total_steps: int
    d: object
    trained: torch.nn.Module
    bundle: object = None  # the data: which unit each validation example belongs to (lab/run/outcomes.py)
    fp16_path: str = "n/a"  # which kernels computed the reduced-precision ops (lab/run/train.py)
    memory: StepMemory | None = None  # the training step's peak memory, the lab's additions outside it
    batches: list = dataclasses.field(default_factory=list)  # the current optimizer step's micro-batches
    pending: list = dataclasses.field(default_factory=list)  # logged steps whose values are still on the device
    last_save: float = dataclasses.field(default_factory=lambda: time.monotonic())  # the clock read when called

    def __post_init__(self):
        c = self.components
        full = c.get("sharded")  # FSDP2: model and optimizer are checkpointed together, as full state dicts
        self.model, self.optimizer = (full.model, full.optimizer) if full is not None else (c["model"], c["optimizer"])
        self.schedule = c["schedule"]
        self.scaler, self.monitor = c["scaler"], c["monitor"]
        self.planter = c.get("faults")  # planted faults (lab/run/faults.py), when the config has any
        self.adapters = c.get("adapters")  # LoRA adapters' norms and gradients (lab/numerics/adapters.py)
        self.recipe = c.get("recipe")  # an FP8/FP4 recipe's state (lab/fp8/state.py)
        self.sharded = "sharded" in c  # FSDP2 (lab/run/sharding.py)
        self.t = self.cfg.train
        self.memory = self.memory or StepMemory(self.device)
        # the loss is divided by this before backward: a real accumulation's micro-batch count times the
        # emulated one (whose factor the gradient gets back in FP32 before the optimizer, _emulated_accum_back)
        self.divisor = self.t.accum_steps * self.t.emulated_accum
        self.tag = f"[{self.cfg.model.family}/{self.cfg.mode.name}/seed{self.cfg.seed}]"
        self.clip_groups = clip_groups(self.model, self.t.clip_groups)

    @property
    def done(self) -> bool:
        return bool(self.state.diverged_reason) or self.state.step >= self.total_steps

    def run(self) -> None:
        self.model.train()
        if self.t.settle_steps and self.state.step == 0 and self.state.micro == 0 and not self.state.settle_time:
            self._settle()
        for epoch in range(self.state.epoch, self.t.epochs):
            self._train_epoch(epoch)
            self._evaluate(epoch)
            if self.done:
                break

    def _train_epoch(self, epoch: int) -> None:
        state, t, loader = self.state, self.t, self.train_loader
        if epoch != state.epoch or state.epoch_loader_rng is None:  # a new epoch
            state.epoch, state.micro = epoch, 0
            state.epoch_loader_rng = loader.generator.get_state()
        else:  # the epoch a checkpoint interrupted: the same order, its used micro-batches passed over
            loader.generator.set_state(state.epoch_loader_rng)
        done_before = state.micro
        # in-process loading: the sampler skips the used samples unread. Worker processes: their batches are
        # loaded and dropped, because each worker's augmentation draws depend on every batch it loaded before.
        skip_unread = done_before if loader.num_workers == 0 else 0
        loader.sampler.skip_next = skip_unread * t.batch_size
        self.t_epoch = time.perf_counter()
        for i, (x, y) in enumerate(loader, start=skip_unread):
            if i < done_before:
                continue
            if state.micro == self.steps_per_epoch * t.accum_steps or state.step >= self.total_steps:
                break  # an epoch's last, incomplete step would leak its gradients into the next epoch's first
            self.feed(x, y, epoch)
            if self.done:
                break
        self._flush()
        state.train_time += time.perf_counter() - self.t_epoch

    def feed(self, x, y, epoch: int) -> None:
        """One micro-batch: forward and scaled backward; after a step's last micro-batch, the optimizer step, its
        log rows and any checkpoint due. What _train_epoch runs per batch (and benchmarks/speed/bench_step.py times)."""
        if self.state.micro % self.t.accum_steps == 0:
            self.batches = []  # this step's micro-batches: an overflow step is replayed on them (attribution)
        loss, active_precision = self._micro_batch(x, y, self.batches)
        if self.state.micro % self.t.accum_steps == 0:
            self._optimizer_step(epoch, loss, self.batches, active_precision)
            self._log_and_checkpoint(epoch)

    def _micro_batch(self, x, y, batches: list):
        """Forward and scaled backward of one micro-batch; returns its loss and the precision it ran in."""
        state, t, d = self.state, self.t, self.d
        if state.first_batch_sha is None:
            state.first_batch_sha = files.tensor_digest([x, y])
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.bundle is not None:
            x = self.bundle.prepare(x)  # uint8 images normalised on the device
        active_precision = "fp32" if self.scaler.fp32_fallback else self.cfg.mode.precision
        if state.micro % t.accum_steps == 0:
            self.monitor.begin_step(state.step, self.scaler.get_scale(), active_precision)
            if self.recipe is not None:
                self.recipe.begin_step(state.step)
        batches.append((x, y))
        if self.planter is not None:
            self.planter.arm(state.step, state.micro % t.accum_steps)
        # DDP all-reduces the gradients in the backward of a step's last micro-batch only
        last = (state.micro + 1) % t.accum_steps == 0
        if self.sharded:  # FSDP2: reduce-scatter in the step's last micro-batch only, as DDP's no_sync
            self.model.set_requires_gradient_sync(last)
        with self.trained.no_sync() if d.enabled and not self.sharded and not last else contextlib.nullcontext():
            loss = forward_backward(self.trained, self.loss_fn, x, y, active_precision, self.device,
                                    self.divisor, self.scaler.scale, self.planter)
        if self.planter is not None:
            self.planter.disarm()
        state.micro += 1
        state.samples += y.shape[0] * d.world
        return loss, active_precision

    def _optimizer_step(self, epoch: int, loss, batches: list, active_precision: str) -> None:
        """Unscale, clip, step (or skip), update the scale; the step's values join the pending log rows."""
        state, t, scaler, monitor = self.state, self.t, self.scaler, self.monitor
        if self.recipe is not None:
            self.recipe.end_step()
        with self.memory.outside("census"):
            monitor.after_backward()  # census of the parameter gradients, still scaled
        if monitor.wants_fp32_replay():  # what FP16 flushed: the step again in FP32, counted at this scale
            # an FP16 base model (LoRA) computes in FP32 there too
            with self.memory.outside("census_fp32_replay"), widened_to_fp32(self.model):
                monitor.census_fp32_replay(functools.partial(replay_step, self.model, self.loss_fn, batches,
                                                             scaler.get_scale(), "fp32", self.device, self.divisor,
                                                             None, state.step))
        self._emulated_accum_back()
        if self.sharded and self.planter is not None:  # a param_grad fault in this rank's shard (lab/run/faults.py)
            self.planter.plant_shards(state.step)
        scaler.unscale_(self.optimizer)
        self._adapter_grad_multiplier()
        for max_norm, group in self.clip_groups:  # a branch on its own (train.clip_groups), then everything
            torch.nn.utils.clip_grad_norm_(group, max_norm)
        grad_amax = self._grad_amax()  # the step's largest unscaled gradient, for `lab replay`
        grad_norm = self._grad_norm_clipped(t.grad_clip)
        scale_used = scaler.get_scale()
        lr_used = self.optimizer.param_groups[0]["lr"]
        scaler.step(self.optimizer)
        try:
            scaler.update()
        except ScaleFloorReached as e:  # DeepSpeed's rule ends the run at its minimum scale: a status, no traceback
            state.diverged_reason = str(e)
            log.warning("%s %s", self.tag, e)
        skipped = scaler.last_step_skipped
        replay = None
        if scaler.last_found_inf and skipped:  # parameters unchanged: the step can be run again as it was
            replay = functools.partial(replay_step, self.model, self.loss_fn, batches, scale_used,
                                       active_precision, self.device, self.divisor, self.planter, state.step)
        with self.memory.outside("attribution_replay"):
            first_nonfinite = monitor.end_step(scaler.last_found_inf, replay)
        if self.adapters is not None:
            # after the step (lora_B as it now is), before zero_grad
            self.adapters.observe(state.step, applied_overflow=scaler.last_found_inf and not skipped)
        self.optimizer.zero_grad(set_to_none=True)
        if not skipped:  # a skipped step must not advance the learning-rate schedule
            self.schedule.step()
        if scaler.fallback_step is not None and not state.fallback_logged:
            state.fallback_logged = True
            log.warning("%s %d consecutive skipped steps: continuing in FP32 from step %d",
                        self.tag, scaler.consecutive_skips, state.step)
        state.scales.append(scale_used)
        if self.d.enabled:  # what each rank saw and decided, compared across ranks at the end (train.rank_decisions)
            state.skips.append(int(skipped))
            state.lrs.append(lr_used)
            state.own_found.append(int(scaler.last_found_inf_own))
        if grad_amax is None:  # the policy observed it: the engine's host value
            grad_amax = torch.full((), scaler.last_grad_amax, dtype=torch.float32, device=loss.device)
        self.pending.append((state.step, loss.detach().float() * self.divisor, grad_norm.detach().float(), grad_amax,
                             scale_used, scaler.last_found_inf, skipped, lr_used,
                             "fp32" if scaler.fp32_fallback else active_precision, epoch, first_nonfinite,
                             monitor.last_source, monitor.last_forward))
        state.step += 1

    def _settle(self) -> None:
        """train.settle_steps empty-gradient steps before training: forward and scaled backward of batches drawn
        apart from the training order (a generator of the run's seed: every mode trains on the same order), the
        loss scaler's overflow check and update, then the gradients dropped: no weight, optimizer or schedule
        moves. The scale training starts from is where they left it; their overflows and time are metrics, and the
        scaler's counters restart at training's step 0."""
        t0, scaler, data = time.perf_counter(), self.scaler, self.train_loader.dataset
        pick = torch.Generator().manual_seed(self.cfg.seed)
        rng = checkpoint.rng_state()  # dropout and drop-path draws too: training's own stream, as without them
        overflows = 0
        for _ in range(self.t.settle_steps):
            for _ in range(self.t.accum_steps):  # a whole step's micro-batches: its gradient's magnitude
                rows = [data[int(i)] for i in torch.randint(len(data), (self.t.batch_size,), generator=pick)]
                x, y = (torch.stack(part).to(self.device) for part in zip(*rows))
                x = x if self.bundle is None else self.bundle.prepare(x)
                forward_backward(self.trained, self.loss_fn, x, y, self.cfg.mode.precision, self.device,
                                 self.divisor, scaler.scale)
            if scaler.is_enabled():
                scaler.unscale_(self.optimizer)
                scaler.update()
                overflows += int(scaler.last_found_inf)
            self.optimizer.zero_grad(set_to_none=True)
        if scaler.is_enabled():
            scaler.restart_counters()
        checkpoint.set_rng_state(rng)
        self.state.settle_overflows = overflows
        self.state.settle_time = time.perf_counter() - t0
        self.state.train_time += self.state.settle_time
        print(f"{self.tag} {self.t.settle_steps} empty-gradient steps: {overflows} overflowed, scale now "
              f"{scaler.get_scale():g}", file=self.progress, flush=True)

    def _grad_norm_clipped(self, max_norm):
        """The unscaled gradients' global L2 norm (on the device: no sync), after clipping them to ``max_norm`` when
        one is set. Without one nothing is rewritten: clip_grad_norm_ with an infinite max_norm would multiply every
        gradient by 1 on every step (and by NaN on an overflow step)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norm = torch.nn.utils.get_total_norm(grads)
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return whole(norm)  # sharded parameters: a replicated DTensor holding the global norm

    def _grad_amax(self):
        """The unscaled gradients' largest absolute value, on the device (no sync; inf or NaN on an overflow
        step): what an amax-observing policy sees at unscale_, which `lab replay` hands to the policies it
        replays. None when the scaler's policy observes it itself (amax-history): not computed twice."""
        scaler = self.scaler
        if scaler.is_enabled() and scaler.policy.needs_grad_amax and not scaler.fp32_fallback:
            return None
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        amax = grads_amax(grads)
        if self.sharded:  # this rank's shard: the largest over the ranks (no host sync)
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        return amax

    def _adapter_grad_multiplier(self) -> None:
        """train.adapter_grad_multiplier: the LoRA adapters' unscaled gradients times k before clipping and the
        optimizer (the source study's callback). FP16 has already rounded them: it changes the update, not what
        FP16 flushed."""
        k = self.t.adapter_grad_multiplier
        if k == 1.0 or self.adapters is None:
            return
        grads = [g for _, a, b in self.adapters.pairs for g in (a.grad, b.grad) if g is not None]
        if grads:
            torch._foreach_mul_(grads, k)

    def _emulated_accum_back(self) -> None:
        """Multiply the (still scaled, FP32) parameter gradients by emulated_accum: the step's gradient is then
        what a real emulated_accum-way accumulation would have summed, exactly for a power of two, before the
        scaler unscales, checks and clips it (inf and NaN stay what they are)."""
        if self.t.emulated_accum == 1:
            return
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, float(self.t.emulated_accum))

    def _log_and_checkpoint(self, epoch: int) -> None:
        """At log steps: write the pending rows and a progress line. Save a checkpoint when one is due (every
        checkpoint_every steps or checkpoint_minutes) or a signal asked for one; after a signal, stop."""
        state, t, d = self.state, self.t, self.d
        if state.step % t.log_every == 0 or state.step == self.total_steps:
            self._flush()
            print(f"{self.tag} epoch {epoch + 1}/{t.epochs} step {state.step}/{self.total_steps} loss "
                  f"{state.last_loss:.4f} scale {self.scaler.get_scale():g} skipped {self.scaler.skipped_steps}",
                  file=self.progress, flush=True)
        scheduled = bool(t.checkpoint_every and state.step % t.checkpoint_every == 0)  # equal on every rank
        signalled, timed = self.signals.signum is not None, bool(
            t.checkpoint_minutes and time.monotonic() - self.last_save >= 60 * t.checkpoint_minutes)
        if d.enabled:  # a signal or a clock may differ between ranks: agreed at log steps only, so that other
            # steps add no collective (and no host sync) to the training step
            signalled, timed = d.any([signalled, timed], self.device) if state.step % t.log_every == 0 \
                else (False, False)
        if not (scheduled or signalled or timed):  # every rank saves at the same step
            return
        self._flush()
        state.train_time += time.perf_counter() - self.t_epoch
        self.t_epoch = time.perf_counter()
        rank_rng = d.gather(checkpoint.rng_state()) if d.enabled else None
        with self.memory.outside("checkpoint"):  # a sharded run's gathered full state included
            if self.sharded:
                self.components["sharded"].gather()  # every rank: the full state dicts are a collective
            path = save_checkpoint(self.cfg, self.write_dir, self.components, state, rank_rng) if d.is_main \
                else self.write_dir
            if self.sharded:
                self.components["sharded"].discard()  # a rank that wrote nothing keeps no gathered copy
        self.last_save = time.monotonic()
        if signalled:
            raise checkpoint.Interrupted(self.signals.signum or signal.SIGTERM, path)

    def _flush(self) -> None:
        """Write the pending steps' rows (one host sync for all of them)."""
        if self.adapters is not None:
            self.adapters.flush()
        if not self.pending:
            return
        state, d = self.state, self.d
        values = torch.stack([torch.stack([p[1], p[2], p[3].to(p[1].device)]) for p in self.pending])
        if d.enabled:  # the loss of the global batch: the mean over ranks (the grad norm is already global)
            values[:, 0] = d.mean(values[:, 0].contiguous())
        values = values.tolist()  # one host sync
        rows = []
        for (s, _, _, _, scale, found_inf, skipped, lr, prec, ep, bad, src, fwd), (loss, gnorm, amax) in zip(
                self.pending, values):
            rows.append(dict(step=s, epoch=ep, loss=loss, scale=scale, found_inf=int(found_inf),
                             skipped=int(skipped), grad_norm=gnorm, lr=lr, precision=prec,
                             first_nonfinite_layer=bad, first_nonfinite_source=src, grad_amax=amax,
                             micro_batches=self.t.accum_steps, **forward_columns(fwd)))
        self.steps_log.write(rows)
        state.rows_written += len(rows)
        self.pending.clear()
        state.last_loss = rows[-1]["loss"]
        if not math.isfinite(state.last_loss) and not all(torch.isfinite(local_shard(p)).all() for p in self.params):
            state.diverged_reason = f"parameters became non-finite by step {rows[-1]['step']}"

    def _evaluate(self, epoch: int) -> None:
        # a diverged model is still evaluated: its accuracy is a result, not a gap in the table (DDP: rank 0 only,
        # the other ranks wait for it at the next step's all-reduce)
        state = self.state
        with self.memory.outside("evaluation"):
            self._score()
        state.best_top1 = max(state.best_top1, state.top1)
        state.epochs_done = epoch + 1
        print(f"{self.tag} epoch {epoch + 1}/{self.t.epochs} val top-1 {state.top1:.4f} loss {state.val_loss:.4f}",
              file=self.progress, flush=True)

    def _score(self) -> None:
        state = self.state
        trained = "fp32" if self.scaler.fp32_fallback else self.cfg.mode.precision
        with evaluation_precision(self.model, self.t.eval_precision, trained, self.device) as precision:
            if self.sharded:  # a sharded forward is collective: every rank scores its slice, rank 0 writes
                state.top1, state.val_loss, correct, loss = evaluate_sharded(
                    self.model, self.val_loader, self.device, precision, self.d, len(self.bundle.val),
                    prepare=self.bundle.prepare)
            elif self.d.is_main:
                state.top1, state.val_loss, correct, loss = evaluate(
                    self.model, self.val_loader, self.device, precision, per_example=True,
                    prepare=self.bundle.prepare)
        if self.d.is_main:
            unit, unit_name = outcomes.units_for(self.bundle, len(correct))
            outcomes.write(self.write_dir, correct, loss, unit, unit_name)


def clip_groups(model: torch.nn.Module, groups: dict | None) -> list[tuple[float, list]]:
    """train.clip_groups as (max_norm, parameters) pairs: the trainable parameters whose names start with each
    prefix (a branch: ``encoder`` is encoder.*). A prefix that names no trainable parameter is refused."""
    out = []
    for prefix, max_norm in (groups or {}).items():
        params = [p for name, p in model.named_parameters()
                  if p.requires_grad and (name == prefix or name.startswith(prefix + "."))]
        if not params:
            heads = sorted({name.split(".", 1)[0] for name, _ in model.named_parameters()})
            raise ConfigError(f"train.clip_groups: {prefix!r} names no trainable parameter of the model; its "
                             f"parameters start with {', '.join(heads)}")
        out.append((float(max_norm), params))
    return out

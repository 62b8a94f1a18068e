"""Record a training loop you wrote into a lab run directory: ``rec = lab.record(model, scaler, out="runs/mine")``.

The recording holds the files a lab run writes (``steps.csv``, ``census.csv``, ``grad_hist.csv``, ``metrics.json``,
``provenance.json``, ``config.yaml``), so ``python -m lab diagnose``, ``lab inspect``, ``lab replay``, ``lab
figures`` and the notebooks read it unchanged::

    scaler = torch.amp.GradScaler("cuda")          # or lab.scaling.create("dynamic"), or None (FP32, BF16)
    with lab.record(model, scaler, out="runs/mine") as rec:
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            rec.step(loss)                          # once per optimizer step: after update(), before zero_grad()
            optimizer.zero_grad(set_to_none=True)

What it records per step: the loss, the scale the step used, whether its gradients overflowed and whether it was
skipped (from the scaler: a lab scaler's ``last_found_inf`` / ``last_step_skipped``; ``torch.amp.GradScaler``'s own
found-inf tensors, read just before its ``update()``, never guessed from a change of scale), the unscaled gradient
norm and maximum, the learning rate (``optimizer=``), and on an overflow step the first non-finite layer. Every
``census_every`` steps the gradient census (lab/numerics/monitor.py): the activation gradients through hooks on the
model, the parameter gradients just before the scaler unscales them.

Gradient accumulation: every backward pass that reaches the model's outputs between two ``rec.step`` calls is a
micro-batch (lab/numerics/micro.py); steps.csv's ``micro_batches`` holds each step's count, config.yaml's
``train.accum_steps`` the first step's (or ``accum_steps=`` as declared: a step that differs is warned about once).
On census steps each micro-batch's gradients are counted on their own.

With ``replay=`` (a function that runs the step's last micro-batch again: its forward under your autocast and its
scaled backward, e.g. ``scaler.scale(loss_fn(model(x), y) / accum).backward()`` inside ``with lab.autocast(...)``,
the batch in scope; or all of the step's micro-batches, as a loop without accumulation does with its one batch):

* overflow attribution: the layer whose gradient became non-finite first in backward order, activation or
  parameter gradient; and the forward range: the first module, in forward order, whose output left FP16's range
  (``forward_overflow_module``, its class and largest magnitude), both from one replay of each skipped overflow
  step (at most 32), nothing on clean steps;
* underflow measured: each FP16 census step is replayed in FP32 (every autocast region inside the replay entered
  disabled, lab.numerics.precision.autocast_off) at the same scale, so the census tells flushed values from true
  zeros. Like with like: the replay's k backward passes (counted) are compared with the FP16 counts of the step's
  last k micro-batches, never with the whole step's, so no share can pass 100%. Why the replayed micro-batch and not
  every micro-batch replayed: a loop keeps its last batch in scope, not the step's; and each micro-batch's FP16
  values are set by its own backward (loss / accum), so one micro-batch measures what FP16 flushes as well as all.
  The census rows of a replayed step (census.csv) are those k micro-batches'; of other steps, every micro-batch's.

While a replay runs, ``scaler.scale`` multiplies by the scale the step used (after ``update()`` it has moved), and
the generator state is the one the replayed micro-batch's forward started from (the same dropout masks). The
framework adapters build the replay themselves (lab/integrations/: the Trainer's and Lightning's training_step, an
accelerate or Fabric forward whose output holds the loss; ``replay=False`` turns it off).

Without it, the first parameter whose gradient is non-finite, in backward order (``first_nonfinite_source``
``param_grad``): an overflow that starts in an activation gradient is named where it first reached a weight; the
forward pass is located from the step after an overflow step, whose training forward is probed (each module's
largest output, in forward order: lab/numerics/forward_range.py; at most 32 probes, their values read with the
logged values); and the underflow is unknown (``lab diagnose`` says so, and flags gradients that are (nearly) all
exactly zero).

Host synchronisation: the per-step values stay on the device and are fetched every ``log_every`` steps in one
transfer; a ``torch.amp.GradScaler`` step adds one small read of its found-inf flag. Under DDP every rank records
(the census hooks are per rank) and only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

from lab.core import files
from lab.numerics.adapters import AdapterLog
from lab.numerics.forward_range import ForwardProbe, Probed
from lab.numerics.micro import BackwardCounter
from lab.numerics.monitor import REPLAY_LIMIT, NumericsMonitor
from lab.run.rundir import StepLog, forward_columns
from lab.scaling.engine import LossScaler, grads_amax, reciprocal

__all__ = ["Recorder", "record", "RecordError"]


class RecordError(ValueError):
    """A recording that cannot start (an --out holding a finished run) or a call out of order."""


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Recorder:
    """Records one training run into ``out`` (module docstring). Use :func:`record` to build one."""

    def __init__(self, model: torch.nn.Module, scaler=None, out: str | Path = "runs/recording", *,
                 optimizer: torch.optim.Optimizer | None = None, precision: str | None = None,
                 census_every: int = 100, log_every: int = 20, replay: Callable[[], None] | None = None,
                 name: str | None = None, seed: int = 0, accum_steps: int | None = None):
        self.model, self.scaler, self.optimizer, self.replay = model, scaler, optimizer, replay
        self.out = Path(out)
        self.is_main = _rank() == 0
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise RecordError(f"log_every must be an int >= 1, got {log_every!r}")
        self.log_every = log_every
        if accum_steps is not None and (isinstance(accum_steps, bool) or not isinstance(accum_steps, int)
                                        or accum_steps < 1):
            raise RecordError(f"accum_steps must be an int >= 1 (micro-batches per optimizer step) or None "
                              f"(detected), got {accum_steps!r}")
        self.accum_declared = accum_steps
        self.accum_steps = accum_steps  # declared, else detected at the first step
        self._accum_warned = False
        enabled = scaler is not None and scaler.is_enabled()
        self.precision = precision or ("fp16" if enabled else "fp32")
        if self.precision not in ("fp16", "bf16", "fp32"):
            raise RecordError(f"precision must be fp16, bf16 or fp32, got {self.precision!r}")
        self.policy = (scaler.policy_name if isinstance(scaler, LossScaler) else
                       "torch.amp.GradScaler" if enabled else "none")
        if self.is_main and (self.out / "metrics.json").exists():
            raise RecordError(f"{self.out}: holds a finished run (metrics.json); record into another folder")
        # with a replay: overflow attribution and the forward range on skipped overflow steps, and on the FP16
        # census steps an FP32 replay that tells flushed values from true zeros (underflow measured, not guessed)
        # each backward pass reaching the model is a micro-batch: counted per step, and the census keeps each one's
        # counts apart, so that a replay of the step's last micro-batch meets its own FP16 counts
        self.counter = BackwardCounter(model)
        self.monitor = NumericsMonitor(model, census_every, attribute=True,
                                       replay_limit=REPLAY_LIMIT if replay else 0,
                                       fp32_replay=replay is not None and self.precision == "fp16", micro=self.counter)
        # without a replay, a step whose gradients overflowed gets the next training forward measured: the first
        # module beyond FP16's range, if the forward pass is where the overflow starts (lab/numerics/forward_range.py)
        # (census_every 0 turns it off with the census and the attribution)
        self.probe = ForwardProbe(model, limit=REPLAY_LIMIT) if self.precision == "fp16" and census_every else None
        self.adapters = AdapterLog(model, log_every)  # a peft LoRA model: adapters.csv (lab/numerics/adapters.py)
        from lab.fp8.model_census import Fp8Census, torchao_autocast_input
        # the lab's FP8 recipe layers or torchao's Float8Linear: fp8_census.csv on census steps (lab/fp8/census.py)
        self.fp8 = Fp8Census(model, census_every)
        from lab.fp8.amax_record import AmaxRecord
        # and every step's amax of each of their operands: fp8_amax.csv, what amax predictors learn from
        self.fp8_amax = AmaxRecord(model) if self.fp8 else None
        if self.fp8.torchao:  # its input cast as a GPU's autocast would (torchao casts under CUDA autocast only)
            torchao_autocast_input(model, self._device().split(":")[0])
        self.identity = {"model": name or type(model).__name__, "mode": f"{self.precision}-{self.policy}",
                         "seed": seed}
        self.step_index, self.pending, self.started = 0, [], time.perf_counter()
        self.counts = {"overflow_steps": 0, "skipped_steps": 0}
        self._found: torch.Tensor | None = None  # GradScaler's found-inf of this step, read before update()
        self._scale_seen: tuple | None = None  # GradScaler's scale tensor when its value was last read: (id, version)
        self._counted = False  # the parameter gradients of this step were counted before unscale_
        self._hook_scaler()
        self.steps_log = None
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            files.atomic_write_yaml(self.out / "config.yaml", self._config(census_every))
            files.atomic_write_json(self.out / "provenance.json", files.provenance(
                self._device(), "recording", files.now_iso(), {"recording": True}))
            self.steps_log = StepLog(self.out)
        self._begin()

    # --- the scaler's hooks -----------------------------------------------------------------------------------
    def _hook_scaler(self) -> None:
        """Count the parameter gradients before the scaler unscales them; read GradScaler's found-inf before its
        update() forgets it (instance attributes: the scaler's class is untouched)."""
        s = self.scaler
        if s is None or not s.is_enabled():
            return
        unscale = s.unscale_

        def unscale_(optimizer):
            self._before_unscale(replay_fp32=True)  # the parameters are still those of the step's backward
            return unscale(optimizer)
        s.unscale_ = unscale_
        if not isinstance(s, LossScaler):
            update = s.update

            def update_(new_scale=None):
                found = [v for st in s._per_optimizer_states.values()
                         for v in st.get("found_inf_per_device", {}).values()]
                self._found = torch.stack([f.reshape(()) for f in found]).sum() if found else None
                return update(new_scale)
            s.update = update_

    def _before_unscale(self, replay_fp32: bool = False) -> None:
        if not self._counted:
            self._counted = True
            # the scale this step's backward used (a reset_scale or load_state_dict after _begin included)
            scale = self._scale_used if self._scale_unchanged() else self._scale()
            if scale != self._scale_used:
                self._scale_used = scale
                self.monitor.set_scale(scale)
            self.monitor.after_backward()
            if replay_fp32 and self.monitor.wants_fp32_replay() and self._replay_ready():
                self.monitor.census_fp32_replay(self._replay_in_fp32)

    def _replay_in_fp32(self) -> None:
        """The user's replay with every autocast region inside it disabled (and an FP16 model widened): the step's
        backward in FP32, at the same loss scale."""
        from lab.models.lora import widened_to_fp32
        from lab.numerics.precision import autocast_off
        with autocast_off(), widened_to_fp32(self.model), self._pinned_scale(), self.fp8.paused():
            self.replay()

    def _replay_ready(self) -> bool:
        """A replay to run: the user's, or one an adapter built once it has captured a micro-batch (``ready``)."""
        return self.replay is not None and getattr(self.replay, "ready", True)

    def _replay_at_step_scale(self) -> None:
        """The user's replay of a skipped overflow step, at the scale the step used (update() has halved it)."""
        with self._pinned_scale(), self.fp8.paused():
            self.replay()

    @contextlib.contextmanager
    def _pinned_scale(self):
        """``scaler.scale`` multiplies by the scale this step's backward used while a replay runs: the attribution
        replay runs after ``update()``, which has moved the scale (an instance attribute; the class is untouched)."""
        s = self.scaler
        if s is None or not s.is_enabled():
            yield
            return
        mine = vars(s).get("scale")
        value = self._scale_used
        s.scale = lambda outputs: _times(outputs, value)
        try:
            yield
        finally:
            if mine is None:
                del s.scale
            else:
                s.scale = mine

    # --- per step -------------------------------------------------------------------------------------------------
    def _scale(self) -> float:
        s = self.scaler
        return float(s.get_scale()) if s is not None and s.is_enabled() else 1.0

    def _scale_unchanged(self) -> bool:
        """GradScaler's scale tensor is the one read last, unmodified since (its in-place version counter): then
        the host value read with the step's outcome holds, and no second read is needed."""
        if isinstance(self.scaler, LossScaler):  # its get_scale is a host value: reading it costs no sync
            return False
        t = getattr(self.scaler, "_scale", None)
        if t is None:
            return False
        if self._scale_seen is None:  # created by the first scale() from init_scale, untouched since
            return t._version == 0 and self._scale_used == getattr(self.scaler, "_init_scale", None)
        return (id(t), t._version) == self._scale_seen

    def _begin(self, next_scale: float | None = None) -> None:
        """A new step: its scale is ``next_scale`` when the last step's one read brought it back, else read."""
        if next_scale is None or not self._scale_unchanged():
            next_scale = self._scale()
        self._scale_used, self._counted, self._found = next_scale, False, None
        self.counter.reset()
        # after a lab scaler's FP32 fallback the steps run in FP32 (lab.integrations switch autocast off)
        self._precision_used = "fp32" if getattr(self.scaler, "fp32_fallback", False) else self.precision
        self.monitor.begin_step(self.step_index, self._scale_used, self._precision_used)
        if self.fp8:
            self.fp8.begin_step(self.step_index)
            self.fp8_amax.begin_step(self.step_index)

    def step(self, loss: torch.Tensor | float) -> None:
        """Record the optimizer step that just ended: call it after ``scaler.update()`` and before
        ``optimizer.zero_grad()``."""
        self._before_unscale()  # no scaler (FP32, BF16): the gradients are counted as they are
        micro = self.counter.count  # backward passes of this step (replays are counted apart)
        self._check_accum(micro)
        found_inf, skipped, next_scale = self._outcome()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        dev = grads[0].device if grads else torch.device("cpu")
        scaled = self.monitor.grad_amaxes  # the maxima the attribution flags took before unscale_, if it did
        if scaled is not None:
            # max(x) * inv == max(x * inv) exactly (rounding is monotonic): what the gradients hold once unscaled
            amax = scaled.max() * torch.full((), reciprocal(self._scale_used), device=scaled.device)
        else:
            amax = grads_amax(grads) if grads else torch.zeros((), device=dev)
        norm = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2))) if grads
                else torch.zeros((), device=dev))
        replay = self._replay_at_step_scale if (found_inf and skipped and self._replay_ready()) else None
        replays = self.monitor.replays
        layer = self.monitor.end_step(found_inf, replay)
        forward = self.monitor.last_forward
        if self.probe is not None:
            forward = forward or self.probe.take()  # this step's forward, probed after the last overflow step
            if found_inf and self.monitor.replays == replays:  # no replay looked at this step's forward
                self.probe.arm()
        loss_t = loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else math.nan
        self.pending.append((self.step_index, loss_t.to(dev), norm.float(), amax.float(), self._scale_used,
                             found_inf, skipped, lr, layer, self.monitor.last_source, self._precision_used,
                             forward, micro))
        self.counts["overflow_steps"] += int(found_inf)
        self.counts["skipped_steps"] += int(skipped)
        self.adapters.observe(self.step_index, applied_overflow=found_inf and not skipped)
        if self.fp8:
            self.fp8.end_step()  # a census step's operand rows, fetched in one transfer
            self.fp8_amax.end_step()
        self.step_index += 1
        if self.step_index % self.log_every == 0:
            self._flush()
        self._begin(next_scale)

    def _outcome(self) -> tuple[bool, bool, float | None]:
        """(found inf, skipped, the scale update() left or None): under torch's GradScaler one host read brings
        back its found-inf and its new scale together (record.md: one read per step, on a GPU one sync)."""
        s = self.scaler
        if s is None or not s.is_enabled():
            return False, False, None
        if isinstance(s, LossScaler):
            return bool(s.last_found_inf), bool(s.last_step_skipped), None
        if self._found is None:
            raise RecordError("rec.step() found no update() of the GradScaler this step: call scaler.update() "
                              "before rec.step()")
        scale = s._scale
        found, next_scale = torch.stack([self._found.float().reshape(()), scale.float().reshape(())]).tolist()
        self._scale_seen = (id(scale), scale._version)
        return found > 0, found > 0, next_scale  # GradScaler always skips an overflow step

    def _flush(self) -> None:
        self.adapters.flush()
        if not self.pending:
            return
        # one transfer: each row's loss, norm and maximum, then the probed forwards' measures
        probed = [p[11] for p in self.pending if isinstance(p[11], Probed)]
        flat = [v for p in self.pending for v in (p[1], p[2], p[3])] + [v for f in probed for v in f.values()]
        values = torch.stack([v.to(flat[0].device) for v in flat]).tolist()  # one sync
        found, at = {}, 3 * len(self.pending)
        for f in probed:
            n = len(f.values())
            found[id(f)], at = f.first_beyond(values[at:at + n]), at + n
        rows = [dict(step=s, epoch=0, loss=values[3 * i], scale=scale, found_inf=int(f), skipped=int(k),
                     grad_norm=values[3 * i + 1], lr=lr, precision=prec, first_nonfinite_layer=layer,
                     first_nonfinite_source=src, grad_amax=values[3 * i + 2], micro_batches=micro,
                     **forward_columns(found.get(id(fwd)) if isinstance(fwd, Probed) else fwd))
                for i, (s, _, _, _, scale, f, k, lr, layer, src, prec, fwd, micro) in enumerate(self.pending)]
        self.pending.clear()
        self.last_loss = rows[-1]["loss"]
        if self.steps_log is not None:
            self.steps_log.write(rows)

    # --- the end ----------------------------------------------------------------------------------------------
    def close(self, error: BaseException | None = None, **extra) -> dict:
        """Write steps.csv, the census and metrics.json (``extra``: your own numbers, e.g. final_val_loss=...);
        returns the metrics. ``error``: the exception that ended training (status ``failed``)."""
        self.monitor.close()
        self.counter.close()
        if self.fp8:
            self.fp8.end_step(keep=False)  # the step begun after the last rec.step(): never recorded
            self.fp8_amax.end_step(keep=False)
            self.fp8_amax.close()
        if self.probe is not None:
            self.probe.disarm()
        self._flush()
        s = self.scaler
        status = "failed" if error is not None else "ok"
        last = getattr(self, "last_loss", math.nan)
        if status == "ok" and self.step_index and not math.isfinite(last):
            status = "diverged"
        metrics = {**self.identity, "recording": True, "precision": self.precision, "scaler": self.policy,
                   "status": status, "steps": self.step_index, **self.counts,
                   "update_ratio": 1 - self.counts["skipped_steps"] / self.step_index if self.step_index else 1.0,
                   "final_scale": self._scale(), "final_train_loss": last, "wall_s": time.perf_counter() - self.started,
                   "alerts": getattr(s, "alerts", None), "fallback_step": getattr(s, "fallback_step", None),
                   "scale_resets": list(getattr(s, "scale_resets", [])), "device": self._device(),
                   "diverged": status == "diverged", "accum_steps": self.accum_steps,
                   "forward_probes": self.probe.probes if self.probe is not None else 0,
                   "census_unmatched_replays": self.monitor.mismatched_replays,
                   "diverged_reason": "the training loss is not finite" if status == "diverged" else "",
                   **({"error": "".join(traceback.format_exception_only(type(error), error)).strip()}
                      if error is not None else {}), **extra}
        if self.is_main:
            metrics.update(self.monitor.finish(self.out))
            if self.adapters:
                self.adapters.write(self.out)
                metrics.update(self.adapters.metrics())
            if self.fp8:
                self.fp8.write(self.out)
                self.fp8_amax.write(self.out)
                # as a lab run's metrics say it (lab/fp8/state.py): the recipe, its layers, the linears left in
                # BF16 (keep_high, or features not whole blocks of the format)
                metrics.update({"recipe": self.fp8.recipe()[0].name, "recipe_layers": len(self.fp8.layers) +
                                len(self.fp8.torchao), "recipe_kept_high": list(getattr(self.model,
                                                                                       "lab_recipe_kept", []))})
            self.steps_log.publish()
            files.atomic_write_json(self.out / "metrics.json", files.json_safe(metrics))
        else:
            metrics.update(self.monitor.finish(None))
        return metrics

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    # --- helpers ------------------------------------------------------------------------------------------------
    def _check_accum(self, micro: int) -> None:
        """The first step's micro-batch count is the run's accumulation (unless declared; config.yaml rewritten
        with it); a step that differs from the declared count is said once (a last, shorter step of an epoch)."""
        if self.accum_steps is None and self.step_index == 0:
            self.accum_steps = micro or None
            if self.is_main and self.accum_steps:
                files.atomic_write_yaml(self.out / "config.yaml", self._config(self.monitor.every))
        if self.accum_declared is not None and micro != self.accum_declared and not self._accum_warned:
            self._accum_warned = True
            warnings.warn(f"lab.record: step {self.step_index} ran {micro} backward passes through the model, "
                          f"accum_steps={self.accum_declared} was declared (steps.csv micro_batches holds each "
                          "step's count)", stacklevel=3)

    def _device(self) -> str:
        p = next(self.model.parameters(), None)
        return str(p.device) if p is not None else "cpu"

    def _config(self, census_every: int) -> dict:
        scaler = {"policy": self.policy}
        if isinstance(self.scaler, LossScaler):
            scaler.update({k: v for k, v in vars(self.scaler.policy).items()
                           if not k.startswith("_") and isinstance(v, (int, float, bool, str))})
        mode = {"name": self.identity["mode"], "precision": self.precision, "scaler": scaler}
        if self.fp8:  # what lab diagnose reports and lab replay rebuilds (a lab run's config holds it the same way)
            recipe, mode["fp8_layers"] = self.fp8.recipe()
            mode["recipe"] = dict(recipe.spec) or {"name": recipe.name}
        from lab.models import qat
        fake = qat.settings_of(self.model)  # torchao's fake quantizers (QAT), as a lab run's mode names them
        if fake is not None:
            mode["qat"] = fake
        return {"recording": True, "model": {"family": self.identity["model"]}, "mode": mode,
                "seed": self.identity["seed"], "train": {"census_every": census_every,
                                                         # declared, or detected at the first step (1 until then)
                                                         "accum_steps": self.accum_steps or 1,
                                                         "emulated_accum": 1, "log_every": self.log_every,
                                                         # the learning rate at the start (steps.csv logs each
                                                         # step's): what lab diagnose quotes
                                                         **({"lr": self.optimizer.param_groups[0]["lr"]}
                                                            if self.optimizer is not None else {})}}


def _times(outputs, value: float):
    """``outputs`` (a tensor or nested lists/tuples of them) times ``value``, an FP32 scalar as the scalers multiply."""
    if isinstance(outputs, torch.Tensor):
        return outputs * torch.full((), value, dtype=torch.float32, device=outputs.device)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_times(o, value) for o in outputs)
    return map(lambda o: _times(o, value), outputs)


def record(model: torch.nn.Module, scaler=None, out: str | Path = "runs/recording", **kw) -> Recorder:
    """A :class:`Recorder` of ``model`` trained with ``scaler`` (a lab scaler, a ``torch.amp.GradScaler``, or None),
    writing into ``out``. Keywords: ``optimizer`` (its learning rate is logged), ``precision`` (default fp16 with
    an enabled scaler, else fp32), ``census_every`` (100; 0 turns the census and the overflow attribution off),
    ``log_every`` (20), ``replay`` (overflow
    attribution, module docstring), ``name`` (the model's name in the tables), ``seed``, ``accum_steps``
    (micro-batches per optimizer step; detected when not given)."""
    return Recorder(model, scaler, out, **kw)

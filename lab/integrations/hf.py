"""accelerate and the transformers Trainer with a lab scaler, FP16 for real on a CPU, recorded: one line.

    accelerator = Accelerator(mixed_precision="fp16")
    use_lab_scaler(accelerator, "dynamic", out="runs/mine")      # before accelerator.prepare(...)

    trainer = Trainer(model, TrainingArguments(..., fp16=True), ...)
    use_lab_trainer(trainer, "dynamic", out="runs/mine")         # before trainer.train()

What each fixes (tests/test_integrations.py shows each trap with the real packages):

* accelerate takes another scaler only when ``native_amp`` and ``scaler`` are set before ``prepare()``: set after,
  training breaks silently. ``use_lab_scaler`` refuses an accelerator that has prepared anything.
* ``mixed_precision="fp16"`` (and the Trainer's ``fp16=True``) on a CPU trains in FP32 without a word: no autocast,
  no scaler. Here FP16 autocast is on, under the lab's tensor-core contract (``contract=False``: the CPU's native
  FP16 kernels, with a warning).
* ``optimizer_step_was_skipped`` is guessed from whether the wrapped optimizer's ``step`` ran: a fused optimizer
  (the Trainer's default AdamW is fused) always runs it, so a skipped step counts as taken and the learning-rate
  schedule advances. Here it is the scaler's own ``last_step_skipped``.
* the scaler's FP32 fallback: once it fires, autocast is off and training continues in FP32.
* gradient checkpointing (``gradient_checkpointing=True``; TRL's configs turn it on) recomputes each layer's forward
  inside backward, where the contract is no longer entered: the recomputed activations differ (a CheckpointError).
  Here it recomputes under the forward's precision (``checkpoint_in_precision``): the gradients without checkpointing.
* FP16 trainable parameters (LoRA adapters cast to FP16 with a ``.half()`` base) are refused before the first step
  (``lab.scaling.check_trainable_dtypes``: ``use_lab_trainer`` at once, ``use_lab_scaler`` when the optimizer is
  prepared), with the fix; FP32 adapters over an FP16 base train.

``policy=None``: a BF16 accelerator or Trainer (``bf16=True``), no scaler, its forward under the contract on a CPU,
recorded (a torchao float8 model's census included: docs/integrations.md, "FP8 with torchao").

The recording (``out``): ``lab.record`` over the prepared model, one row per optimizer step, the loss being the sum
of the step's micro-batch losses as ``accelerator.backward`` received them; metrics.json when
``close_recording(accelerator)`` is called (the Trainer: at the end of ``train()``). Its replay is built here (``replay=False``: none;
a function: yours): the Trainer's ``training_step`` on the inputs it last received; in an accelerate loop, the prepared
model's last training forward and ``accelerator.backward``, when the loss is the model's own output (docs/integrations.md). The scaler's state is what
accelerate and the Trainer save as ``scaler.pt`` in a checkpoint and load on resume.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch
from transformers import TrainerCallback

from lab.integrations.common import (BuiltReplay, IntegrationError, StepLoss, check_contract,
                                     checkpoint_in_precision, fp16_context, lab_scaler, replay_option,
                                     torchao_autocast_input, without_sync, wrap_forward)
from lab.run.record import Recorder
from lab.scaling.adapters import check_trainable_dtypes

__all__ = ["use_lab_scaler", "use_lab_trainer", "close_recording", "LabTrainerCallback"]

_RECORD_KEYS = ("census_every", "log_every", "name", "seed", "replay")
_UNSCALED = {"bf16": "bf16", "no": "fp32"}  # mixed_precision without a loss scaler: the recording's precision


def use_lab_scaler(accelerator, policy="dynamic", *, out=None, contract: bool = True, **kw: Any):
    """Put lab policy ``policy`` (a name and its parameters, or a lab scaler) into ``accelerator`` (built with
    ``mixed_precision="fp16"``, nothing prepared yet); record into ``out`` when given. Returns the scaler.

    ``policy=None``: no loss scaler, for an accelerator built with ``mixed_precision="bf16"`` (or ``"no"``): its
    forward under the contract on a CPU (BF16), the run recorded into ``out`` (an FP8 model's census included).
    Returns None."""
    mixed = accelerator.mixed_precision
    if policy is None:
        if mixed not in _UNSCALED:
            raise IntegrationError(f"policy=None (no loss scaler) records a BF16 or FP32 run; the accelerator's "
                                   f"mixed_precision is {mixed!r}: FP16 needs a lab policy (e.g. 'dynamic')")
    elif mixed != "fp16":
        raise IntegrationError(f"the accelerator's mixed_precision is {mixed!r}: build it with "
                               "mixed_precision='fp16' (or the Trainer with fp16=True) to use a loss scaler"
                               + ("; BF16 needs none: pass policy=None to record it" if mixed in _UNSCALED else ""))
    if accelerator._models or accelerator._optimizers:
        raise IntegrationError("the accelerator has already prepared a model or optimizer: accelerate reads its scaler "
                               "in prepare(), so call use_lab_scaler before accelerator.prepare(...)")
    device = accelerator.device.type
    record_kw = {k: kw.pop(k) for k in _RECORD_KEYS if k in kw}
    precision = _UNSCALED.get(mixed, "fp16")
    if policy is None:
        if kw:
            raise IntegrationError(f"policy parameters {sorted(kw)} given with policy=None (no loss scaler)")
        scaler = None
        contract = precision == "bf16" and check_contract(device, contract, torch.bfloat16)
    else:
        scaler = lab_scaler(policy, device, **kw)
        accelerator.native_amp, accelerator.scaler = True, scaler
        contract = check_contract(device, contract)
    state = _State(scaler, device, contract, out, record_kw, accelerator, precision)
    accelerator._lab = state
    _wrap(accelerator, "prepare_model", state.prepared_model)
    _wrap(accelerator, "prepare_optimizer", state.prepared_optimizer)
    backward = accelerator.backward
    state.backward = backward

    @functools.wraps(backward)
    def backward_(loss, **kwargs):
        if state.built is not None and state.built.replaying:  # the replay's own backward: not a new micro-batch
            return backward(loss, **kwargs)
        state.step_loss.add(loss)
        state.saw_backward(loss, kwargs)
        return backward(loss, **kwargs)
    accelerator.backward = backward_
    return scaler


def close_recording(accelerator, error: BaseException | None = None) -> dict | None:
    """Write the recording's metrics.json (``use_lab_scaler(..., out=...)``); returns the metrics."""
    state = getattr(accelerator, "_lab", None)
    if state is None or state.recorder is None:
        return None
    metrics, state.recorder = state.recorder.close(error=error), None
    return metrics


def _wrap(accelerator, name: str, after) -> None:
    """Call ``after(result)`` on what ``accelerator.<name>`` returns (an instance attribute: the class is untouched)."""
    original = getattr(accelerator, name)

    @functools.wraps(original)
    def wrapped(obj, *args, **kwargs):
        return after(original(obj, *args, **kwargs))
    setattr(accelerator, name, wrapped)


class _State:
    def __init__(self, scaler, device: str, contract: bool, out, record_kw: dict, accelerator, precision: str):
        self.scaler, self.device, self.contract, self.precision = scaler, device, contract, precision
        self.accelerator = accelerator
        self.out = out
        self.record_kw, option = replay_option(record_kw)
        # the replay lab.record runs (an FP32 census replay, an overflow step's attribution): the user's, or built
        # here from each micro-batch (the Trainer's training_step; an accelerate loop's forward when the loss is
        # the model's own output), or none (replay=False)
        self.built = BuiltReplay() if option is True else None
        self.replay = self.built if option is True else option or None
        self.trainer = None  # use_lab_trainer: the replay runs the Trainer's training_step again
        self.recorder: Recorder | None = None
        self.step_loss = StepLoss()
        self.backward = None

    def prepared_model(self, model):
        wrap_forward(model, self.scaler, self.device, self.contract)
        torchao_autocast_input(model, self.device)  # torchao's Float8Linear given its input as CUDA autocast would
        checkpoint_in_precision(model)  # a Hugging Face model's gradient checkpointing recomputes under the contract
        if self.built is not None:  # an accelerate loop's last forward (the Trainer replays its training_step)
            self.built.capture_forward(model, when=lambda: self.trainer is None)
        if self.out is not None and self.recorder is None:
            self.recorder = Recorder(model, self.scaler, self.out, replay=self.replay, precision=self.precision,
                                     **self.record_kw)
        return model

    def saw_backward(self, loss, kwargs: dict) -> None:
        """An accelerate loop's micro-batch: replayable exactly when its loss is the model's own output's."""
        if self.built is None or self.trainer is not None:
            return

        def run_again(model, args, kw, pick):
            with without_sync(model):
                self.backward(pick(model(*args, **kw)), **kwargs)
        self.built.after_backward(loss, run_again)

    def prepared_optimizer(self, optimizer):
        # FP16 trainable parameters (e.g. LoRA adapters cast with their .half() base): refused here, before the
        # first step, with the fix (a fused optimizer with no clipping would train them in FP16 without a word)
        if self.scaler is not None:
            check_trainable_dtypes(optimizer, model=self.accelerator._models)
        step = optimizer.step

        def step_(opt, *args, **kwargs):
            result = step(*args, **kwargs)
            if opt.gradient_state.sync_gradients:  # an optimizer step, not an accumulation micro-batch
                if self.scaler is not None:
                    opt._is_overflow = bool(self.scaler.last_step_skipped)  # what step_was_skipped reports
                if self.recorder is not None:
                    self.recorder.optimizer = opt.optimizer
                    self.recorder.step(self.step_loss.take())
                else:
                    self.step_loss.take()
            return result
        # a bound method, as torch's LR schedulers expect of optimizer.step (they wrap its __func__)
        optimizer.step = types.MethodType(functools.wraps(step)(step_), optimizer)
        return optimizer


class LabTrainerCallback(TrainerCallback):
    """Adds the scaler's state to the Trainer's logs and closes the recording when training ends."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        scaler = self.accelerator.scaler
        if scaler is None:  # a BF16 run (use_lab_trainer(trainer, None, ...)): nothing scaled to report
            return
        values = dict(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps,
                      overflow_steps=scaler.overflow_steps)
        logs.update(values)  # what the callbacks after this one (printers, loggers) receive
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the Trainer copied the logs there before calling back

    def on_train_end(self, args, state, control, **kwargs):
        # a train() that raises never gets here: close_recording(trainer.accelerator, error=e) records the failure
        close_recording(self.accelerator)


def use_lab_trainer(trainer, policy="dynamic", *, out=None, contract: bool = True, **kw: Any):
    """Put lab policy ``policy`` into a transformers ``trainer`` built with ``fp16=True``, before ``train()``;
    record into ``out`` when given. Returns the scaler. ``policy=None``: a Trainer built with ``bf16=True`` (or
    neither), no loss scaler, recorded into ``out`` (returns None)."""
    if policy is None:
        if trainer.args.fp16:
            raise IntegrationError("policy=None (no loss scaler) records a BF16 or FP32 run; the Trainer was built "
                                   "with fp16=True: FP16 needs a lab policy (e.g. 'dynamic')")
    elif not trainer.args.fp16:
        raise IntegrationError("the Trainer was built without fp16=True: there is no FP16 step to scale"
                               + ("; BF16 needs no scaler: pass policy=None to record it" if trainer.args.bf16
                                  else ""))
    else:
        check_trainable_dtypes(trainer.model)  # FP16 trainable parameters (LoRA adapters): refused before train()
    acc = trainer.accelerator
    # gradient checkpointing (TRL's configs turn it on) recomputes the forward inside backward: under the forward's
    # precision (the CPU contract, a recipe layer's state), not outside it
    checkpoint_in_precision(trainer.model)
    # a Trainer may prepare models of its own in __init__ (TRL's DPOTrainer its reference model): allowed, and given
    # the FP16 forward accelerate would have given them, as long as the model it trains and its optimizer are not
    early = [m for m in acc._models if m is not trainer.model and getattr(m, "module", None) is not trainer.model]
    if acc._optimizers or len(early) < len(acc._models):
        raise IntegrationError("the Trainer's accelerator has already prepared its model or optimizer: call "
                               "use_lab_trainer before trainer.train()")
    saved, acc._models = acc._models, []
    try:
        scaler = use_lab_scaler(acc, policy, out=out, contract=contract, **kw)
    finally:
        acc._models = saved
    state = acc._lab
    for model in early:  # their forward under FP16 autocast (and the contract on a CPU), as the trained model's
        if scaler is None:  # BF16: accelerate gave them its autocast already; the contract added, as to the model's
            wrap_forward(model, None, state.device, state.contract)
            continue
        forward = model.forward

        @functools.wraps(forward)
        def forward_(*args, _forward=forward, **kwargs):
            with fp16_context(scaler, state.device, state.contract):
                return _forward(*args, **kwargs)
        model.forward = forward_
    if state.built is not None:  # the replay: the Trainer's own training_step on the micro-batch it last ran
        state.trainer = trainer
        training_step = trainer.training_step

        @functools.wraps(training_step)
        def training_step_(model, inputs, *args, **kwargs):
            if not state.built.replaying:
                def run():
                    with without_sync(model):
                        training_step(model, inputs, *args, **kwargs)
                state.built.run = run
            return training_step(model, inputs, *args, **kwargs)
        trainer.training_step = training_step_
    # first, so that the printing and logging callbacks already see the scaler's values
    trainer.callback_handler.callbacks.insert(0, LabTrainerCallback(trainer.accelerator))
    return scaler

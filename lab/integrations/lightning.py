"""Lightning (Trainer and Fabric) with a lab scaler, FP16 for real on a CPU, recorded: one line.

    trainer = L.Trainer(accelerator="cpu", plugins=[LabPrecision("dynamic", out="runs/mine")])
    fabric = L.Fabric(accelerator="cuda", plugins=[LabFabricPrecision("dynamic", out="runs/mine")])

The plugin's device is the module's once the Trainer or Fabric has moved it (``device=`` need not be given; one
given that differs from the module's is refused).

Why a plugin and not ``precision="16-mixed"``: on a CPU, Lightning and Fabric turn "16-mixed" into bf16 (with a
warning); a precision plugin is used as given. ``LabPrecision`` is Lightning's own ``MixedPrecision`` with the lab's
scaler in place of ``torch.amp.GradScaler`` (the same calls, in the same order: bit for bit the same training with
``dynamic``), plus:

* on a CPU, the forward under the tensor-core contract (``contract=False``: the CPU's native FP16 kernels, with a
  warning);
* the scaler's FP32 fallback honoured: once it fires, autocast is off and training continues in FP32;
* the run recorded into ``out`` (``lab.record``: steps.csv with each step's scale, overflow and skip from the
  scaler, the census, metrics.json at the end of fit), when ``out`` is given, with a replay built from the last
  micro-batch (the LightningModule's ``training_step``; Fabric: the module's forward when the loss is its own output;
  ``replay=False``: none);
* a Hugging Face model's gradient checkpointing recomputed under the forward's precision (the contract), as
  ``lab.checkpoint`` does for a module's own checkpointed blocks;
* ``plugin.skipped_steps`` / ``plugin.overflow_steps``: from the scaler, which knows (Lightning logs neither);
* FP16 trainable parameters (LoRA adapters cast to FP16 with a ``.half()`` base) refused before the first step, with
  the fix (``lab.scaling.check_trainable_dtypes``: the Trainer's optimizers, Fabric's module in ``setup``).

``policy=None``: BF16 autocast without a scaler (Lightning's ``"bf16-mixed"``), under the contract on a CPU, recorded
(a torchao float8 model's census included: docs/integrations.md, "FP8 with torchao").

The scaler's state travels in Lightning's checkpoints (the plugin's ``state_dict``) and is restored on resume.
Fabric: ``fabric.clip_gradients`` raises on every overflow step unless ``error_if_nonfinite=False`` (an FP16 run
with a scaler overflows by design; the scaler skips the step): pass it.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from lightning.fabric.plugins.precision.amp import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

from lab.integrations.common import (BuiltReplay, IntegrationError, StepLoss, check_contract,
                                     checkpoint_in_precision, fp16_context, lab_scaler, replay_option,
                                     torchao_autocast_input, without_sync)
from lab.run.record import Recorder
from lab.scaling.adapters import check_trainable_dtypes

__all__ = ["LabPrecision", "LabFabricPrecision"]


class _LabPlugin:
    """What both plugins add to Lightning's MixedPrecision (the scaler is ``self.scaler``)."""

    def _setup(self, device: str | None, contract: bool, out, record_kw: dict) -> None:
        self.contract_wanted, self.module, self.contract = contract, None, False
        # no scaler (policy=None): BF16 autocast, recorded as bf16
        self.dtype = torch.float16 if self.scaler is not None else torch.bfloat16
        self.device = None
        if device is not None:
            self._use_device(device)
        self.out = out
        self.record_kw, option = replay_option(record_kw)
        # lab.record's replay: the user's, built here from each micro-batch (on by default), or none (replay=False)
        self.built = BuiltReplay() if option is True else None
        self.replay = self.built if option is True else option or None
        self.recorder: Recorder | None = None
        self.step_loss = StepLoss()

    def _use_device(self, device) -> None:
        self.device = torch.device(device).type
        if self.scaler is not None:
            self.scaler._device = self.device  # the device type the scaler's state belongs to (GradScaler's)
        self.contract = check_contract(self.device, self.contract_wanted, self.dtype)

    def _check_module_device(self, module) -> None:
        """The device is the module's, once the Trainer or Fabric has moved it: taken when none was given, and a
        plugin told one device while the module sits on another is refused (autocast on the wrong device would
        train in FP32 while every record says FP16)."""
        param = next(module.parameters(), None) if module is not None else None
        if param is None:
            if self.device is None:
                raise IntegrationError("the plugin's device is unknown: the module has no parameters to take it "
                                       "from; pass device='cuda' or device='cpu'")
            return
        seen = param.device.type
        if self.device is None:
            self._use_device(seen)
        elif seen != self.device:
            raise IntegrationError(f"the plugin was given device={self.device!r} but the module is on {seen!r}: "
                                   f"autocast would not reach it; pass device={seen!r} or leave device unset")

    def autocast_context_manager(self):
        if self.module is not None:  # the first forward, the module on its device: checked once
            self._check_module_device(self.module)
            self.module = None
        if self.device is None:
            raise IntegrationError("the plugin's device is unknown before the module is set up: pass device=")
        return fp16_context(self.scaler, self.device, self.contract, cache_enabled=False, dtype=self.dtype)

    def forward_context(self):
        return self.autocast_context_manager()

    def convert_input(self, data):
        # Fabric casts the inputs to FP16 for autocast; after the FP32 fallback the forward has no autocast to
        # take FP16 inputs into FP32 weights, so they go in as the user gave them
        if getattr(self.scaler, "fp32_fallback", False):
            return data
        return super().convert_input(data)

    def convert_module(self, module):
        self.module = module  # not yet on its device (Trainer and Fabric move it after): checked at the first forward
        checkpoint_in_precision(module)  # a Hugging Face model's gradient checkpointing recomputes under the contract
        # torchao's Float8Linear given its input as CUDA autocast would (its hook acts under CPU autocast only)
        torchao_autocast_input(module, self.device or "cpu")
        if self.out is not None and self.recorder is None:
            if self.built is not None:
                self._capture(module)
            self.recorder = Recorder(module, self.scaler, self.out, replay=self.replay,
                                     precision="fp16" if self.scaler is not None else "bf16", **self.record_kw)
        return module

    def _scaled_backward(self, loss) -> None:
        """A replay's backward: the loss scaled as the plugin scales it (the recorder pins the step's scale)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _recorded(self, optimizer) -> None:
        if self.recorder is not None:
            self.recorder.optimizer = getattr(optimizer, "optimizer", optimizer)  # the learning rate it logs
            self.recorder.step(self.step_loss.take())
        else:
            self.step_loss.take()

    def teardown(self) -> None:
        if self.recorder is not None:
            # Lightning tears down inside its `except` when fit raised: the recording says `failed`, with the error
            self.recorder.close(error=sys.exc_info()[1])
            self.recorder = None

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler is not None else 0

    @property
    def overflow_steps(self) -> int:
        return self.scaler.overflow_steps if self.scaler is not None else 0


def _precision(policy, device: str | None, params: dict) -> tuple:
    """Lightning's MixedPrecision arguments: FP16 with the lab's scaler, or BF16 without one (``policy=None``)."""
    if policy is None:
        if params:
            raise IntegrationError(f"policy parameters {sorted(params)} given with policy=None (BF16, no loss scaler)")
        return "bf16-mixed", device or "cpu", None
    return "16-mixed", device or "cpu", lab_scaler(policy, device or "cpu", **params)


def _split(kw: dict) -> tuple[dict, dict]:
    """Recorder keywords apart from the policy's parameters."""
    keys = ("census_every", "log_every", "name", "seed", "replay")
    return {k: kw.pop(k) for k in keys if k in kw}, kw


class LabPrecision(_LabPlugin, MixedPrecision):
    def _capture(self, module) -> None:
        """The replay: the LightningModule's training_step again on the batch it last ran (automatic
        optimization), its loss divided as Lightning divides it under accumulate_grad_batches, its logging muted."""
        training_step = module.training_step

        def training_step_(*args, **kwargs):
            if not self.built.replaying and getattr(module, "automatic_optimization", True):
                def run():
                    log, log_dict = module.log, module.log_dict
                    module.log = module.log_dict = lambda *a, **k: None  # self.log is refused outside the hook
                    try:
                        with without_sync(module), self.forward_context():
                            out = training_step(*args, **kwargs)
                        loss = out["loss"] if isinstance(out, dict) else out
                        self._scaled_backward(loss / module.trainer.accumulate_grad_batches)
                    finally:
                        module.log, module.log_dict = log, log_dict
                self.built.run = run
            return training_step(*args, **kwargs)
        module.training_step = training_step_

    def pre_backward(self, tensor, module):
        if not (self.built is not None and self.built.replaying):
            self.step_loss.add(tensor)  # each micro-batch's loss, divided as Lightning divides it
        return super().pre_backward(tensor, module)

    """Lightning Trainer plugin: FP16 autocast with lab policy ``policy`` (a name and its parameters, or a lab
    scaler), recorded into ``out`` when given (``census_every``, ``log_every``, ``name``, ``seed``: lab.record's)."""

    def __init__(self, policy="dynamic", device: str | None = None, *, out=None, contract: bool = True, **kw: Any):
        record_kw, params = _split(kw)
        super().__init__(*_precision(policy, device, params))
        self._setup(device, contract, out, record_kw)

    def connect(self, model, optimizers, lr_schedulers):
        # the model is on the Trainer's device here: the plugin's device is its
        self._check_module_device(model)
        # the Trainer's optimizers, once configure_optimizers has run and before the first step: FP16 trainable
        # parameters (e.g. LoRA adapters cast with their .half() base) are refused here, with the fix
        for optimizer in optimizers:
            if self.scaler is not None:
                check_trainable_dtypes(optimizer, model=model)
        return super().connect(model, optimizers, lr_schedulers)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._recorded(optimizer)
        return output


class LabFabricPrecision(_LabPlugin, FabricMixedPrecision):
    """Lightning Fabric plugin: as :class:`LabPrecision`; the loss recorded is the one given to
    ``fabric.backward``."""

    def __init__(self, policy="dynamic", device: str | None = None, *, out=None, contract: bool = True, **kw: Any):
        record_kw, params = _split(kw)
        super().__init__(*_precision(policy, device, params))
        self._setup(device, contract, out, record_kw)

    def convert_module(self, module):
        # Fabric shows its precision plugin the module, never the optimizers (fabric.setup): FP16 trainable
        # parameters (e.g. LoRA adapters cast with their .half() base) are refused here, before the first step
        if self.scaler is not None:
            check_trainable_dtypes(module)
        return super().convert_module(module)

    def backward(self, tensor, model, *args: Any, **kwargs: Any) -> None:
        self.step_loss.add(tensor)
        self._saw_backward(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def _capture(self, module) -> None:
        """The replay: the module's last training forward again, when the loss given to fabric.backward is its own
        output (or the output Fabric converted); a loss computed outside the module has none."""
        self.built.capture_forward(module)

    def _saw_backward(self, loss) -> None:
        if self.built is None:
            return

        def run_again(module, args, kwargs, pick):
            with without_sync(module), self.forward_context():
                out = module(*args, **kwargs)
            self._scaled_backward(pick(self.convert_output(out)))
        self.built.after_backward(loss, run_again)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self._recorded(optimizer)
        return output

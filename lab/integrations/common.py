"""What every framework adapter shares: the scaler, the FP16 forward context, the loss of a step."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from lab.numerics.contract import tensor_core_contract
from lab.scaling import create
from lab.scaling.engine import LossScaler

NATIVE_CPU_FP16 = (
    "FP16 autocast on a CPU without the lab's tensor-core contract runs PyTorch's native CPU FP16 kernels: 5-23x "
    "slower than FP32 for a GPT-2 on a CPU without FP16 instructions, and their last bits differ between CPUs "
    "(docs/fp16-cpu.md). Pass contract=True to train FP16 under the contract.")


class IntegrationError(ValueError):
    """An adapter used where it cannot do what it says (e.g. a scaler set after accelerate's prepare())."""


def lab_scaler(policy: str | LossScaler, device: str, **params) -> LossScaler:
    """``policy``: a registered name (built with ``params``) or a lab scaler already built."""
    if isinstance(policy, LossScaler):
        if params:
            raise IntegrationError(f"policy parameters {sorted(params)} given with a scaler already built")
        return policy
    if not isinstance(policy, str):
        raise IntegrationError(f"policy must be a lab policy name or a lab.scaling.LossScaler, got {policy!r} "
                               "(torch.amp.GradScaler needs no adapter: pass it to the framework)")
    return create(policy, device=device, **params)


def check_contract(device: str, contract: bool) -> bool:
    """Whether the contract applies; says loudly when FP16 will run on the CPU's native kernels."""
    if device == "cpu" and not contract:
        warnings.warn(NATIVE_CPU_FP16, stacklevel=3)
    return device == "cpu" and contract


def fp16_context(scaler: LossScaler, device: str, contract: bool, cache_enabled: bool | None = None):
    """The forward pass of an FP16 step: autocast, and on CPU the contract. Once the scaler's FP32 fallback has
    fired, autocast is off (an enclosing autocast too): the run continues in FP32, as the lab's own loop does."""
    if scaler.fp32_fallback:
        return torch.autocast(device_type=device, enabled=False)
    kw = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device, dtype=torch.float16, **kw))
    if contract:
        stack.enter_context(tensor_core_contract())
    return stack


def wrap_forward(module: torch.nn.Module, scaler: LossScaler, device: str, contract: bool) -> None:
    """Run ``module.forward`` under the contract (CPU) and switch autocast off after the FP32 fallback, whatever
    autocast the framework wraps around it. Once per module (a model prepared twice is wrapped once)."""
    if getattr(module, "_lab_forward_wrapped", False):
        return
    forward = module.forward
    # accelerate wraps forward in its own autocast and keeps the plain one as `_original_forward`: an autocast
    # switched off around its wrapper would not reach inside it, so the fallback calls the plain forward
    plain = getattr(module, "_original_forward", forward)

    @functools.wraps(forward)
    def forward_(*args, **kwargs):
        if scaler.fp32_fallback:
            with torch.autocast(device_type=device, enabled=False):
                return plain(*args, **kwargs)
        with tensor_core_contract() if contract else contextlib.nullcontext():
            return forward(*args, **kwargs)
    module.forward = forward_
    module._lab_forward_wrapped = True


class StepLoss:
    """The loss of one optimizer step: the sum of its micro-batches' (already divided) losses."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float().reshape(())
        self.total = loss if self.total is None else self.total + loss

    def take(self) -> torch.Tensor | float:
        total, self.total = self.total, None
        return float("nan") if total is None else total

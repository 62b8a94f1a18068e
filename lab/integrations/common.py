"""What every framework adapter shares: the scaler, the FP16 forward context, the loss of a step."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.utils.checkpoint

from lab.fp8.model_census import torchao_autocast_input  # noqa: F401  (the adapters call it from here)
from lab.numerics.contract import tensor_core_contract
from lab.numerics.recompute import contexts
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


def check_contract(device: str, contract: bool, dtype: torch.dtype = torch.float16) -> bool:
    """Whether the contract applies; says loudly when FP16 will run on the CPU's native kernels (BF16 without it
    runs the CPU's native BF16 kernels, fast where the CPU has them: no warning)."""
    if device == "cpu" and not contract and dtype == torch.float16:
        warnings.warn(NATIVE_CPU_FP16, stacklevel=3)
    return device == "cpu" and contract


def fp16_context(scaler: LossScaler | None, device: str, contract: bool, cache_enabled: bool | None = None,
                 dtype: torch.dtype = torch.float16):
    """The forward pass of a mixed-precision step (FP16 with a scaler; ``dtype`` BF16 with ``scaler`` None):
    autocast, and on CPU the contract. Once the scaler's FP32 fallback has fired, autocast is off (an enclosing
    autocast too): the run continues in FP32, as the lab's own loop does."""
    if getattr(scaler, "fp32_fallback", False):
        return torch.autocast(device_type=device, enabled=False)
    kw = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device, dtype=dtype, **kw))
    if contract:
        stack.enter_context(tensor_core_contract())
    return stack


def wrap_forward(module: torch.nn.Module, scaler: LossScaler | None, device: str, contract: bool) -> None:
    """Run ``module.forward`` under the contract (CPU) and switch autocast off after the FP32 fallback, whatever
    autocast the framework wraps around it (``scaler`` None, BF16: the contract only). Once per module (a model
    prepared twice is wrapped once)."""
    if getattr(module, "_lab_forward_wrapped", False):
        return
    forward = module.forward
    # accelerate wraps forward in its own autocast and keeps the plain one as `_original_forward`: an autocast
    # switched off around its wrapper would not reach inside it, so the fallback calls the plain forward
    plain = getattr(module, "_original_forward", forward)

    @functools.wraps(forward)
    def forward_(*args, **kwargs):
        if getattr(scaler, "fp32_fallback", False):
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


class BuiltReplay:
    """The replay an adapter builds from the micro-batch it just ran (``lab.record``'s ``replay=``, with no user
    code): ``run`` is set after each training micro-batch to a function that runs it again, the same batch through the
    same loss computation under the same autocast, ending in the framework's own scaled backward. While it runs,
    ``replaying`` is set, so that the adapter does not count its loss as a new micro-batch's. ``ready`` is False
    until a micro-batch could be captured exactly (an accelerate or Fabric loop whose loss is computed outside the
    model has none: ``lab.record`` then records without a replay, as without ``replay=``)."""

    def __init__(self) -> None:
        self.run = None
        self.replaying = False
        self._forward = None  # capture_forward's last training forward: (module, args, kwargs, output)

    def capture_forward(self, module: torch.nn.Module, when=lambda: True) -> None:
        """Keep ``module``'s last training forward (while ``when()``), for :meth:`after_backward` (an accelerate or
        Fabric loop, whose loss computation the adapter does not see)."""
        forward = module.forward

        @functools.wraps(forward)
        def forward_(*args, **kwargs):
            output = forward(*args, **kwargs)
            if torch.is_grad_enabled() and not self.replaying and when():
                self._forward = (module, args, kwargs, output)
            return output
        module.forward = forward_

    def after_backward(self, loss: torch.Tensor, run_again) -> None:
        """The micro-batch whose ``loss`` was just given to backward: replayable exactly when it is the captured
        forward's own output; then ``run`` is ``run_again(module, args, kwargs, pick)`` (the adapter's forward and
        scaled backward; ``pick(output)`` finds the loss in a new output), else there is no replay of it. The output
        is not held past this call (it holds the logits)."""
        seen, self._forward = self._forward, None
        pick = loss_in_output(seen[3], loss) if seen is not None else None
        self.run = None if pick is None else functools.partial(run_again, *seen[:3], pick)

    @property
    def ready(self) -> bool:
        return self.run is not None

    def __call__(self) -> None:
        self.replaying = True
        try:
            self.run()
        finally:
            self.replaying = False


def replay_option(record_kw: dict) -> tuple[dict, object]:
    """``replay`` among an adapter's recording keywords: True (the default: the adapter builds it), False (none), or
    the user's own function. Returns the keywords without it, and the option."""
    record_kw = dict(record_kw)
    option = record_kw.pop("replay", True)
    if option is None:
        option = True
    if not (isinstance(option, bool) or callable(option)):
        raise IntegrationError(f"replay must be True (built by the adapter), False or a function, got {option!r}")
    return record_kw, option


def loss_in_output(output, loss: torch.Tensor):
    """How to find ``loss`` in a model's ``output`` again, if it is the output's own (the output itself, its
    ``loss`` entry as a Hugging Face ModelOutput holds it, or its first element), or a dtype conversion of it (Fabric
    converts outputs): a function of a new output, or None when the loss was computed outside the model."""
    def same(t, candidate):
        if t is candidate:
            return True
        fn = getattr(loss, "grad_fn", None)  # loss = candidate.to(float32)
        return (isinstance(candidate, torch.Tensor) and fn is not None and candidate.grad_fn is not None
                and type(fn).__name__.startswith("ToCopyBackward") and fn.next_functions[0][0] is candidate.grad_fn)
    if isinstance(output, torch.Tensor) and same(loss, output):
        return lambda out: out
    if isinstance(output, dict) and "loss" in output and same(loss, output["loss"]):
        return lambda out: out["loss"]
    if isinstance(output, (tuple, list)) and output and same(loss, output[0]):
        return lambda out: out[0]
    return None


def without_sync(model):
    """A replay's backward must not all-reduce (DDP): only this rank runs it."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


def checkpoint_in_precision(model: torch.nn.Module) -> None:
    """Make a Hugging Face model's gradient checkpointing (``gradient_checkpointing_enable()``, the Trainer's
    ``gradient_checkpointing=True``) recompute under its forward's precision: each checkpointed layer's function is
    called with ``use_reentrant=False`` and the lab's ``context_fn`` (lab.numerics.recompute; a ``context_fn`` of the
    user's is kept, entered inside), whether checkpointing is enabled before this call or after. Reentrant
    checkpointing takes no ``context_fn``: it is replaced (transformers' default is non-reentrant)."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            module._gradient_checkpointing_func = _in_precision(func)
        setter = getattr(module, "_set_gradient_checkpointing", None)
        if setter is not None and not getattr(setter, "_lab_precision", False):
            module._set_gradient_checkpointing = _setting_in_precision(setter)


def _setting_in_precision(setter):
    @functools.wraps(setter)
    def set_(enable=True, gradient_checkpointing_func=torch.utils.checkpoint.checkpoint, *args, **kwargs):
        return setter(enable, _in_precision(gradient_checkpointing_func), *args, **kwargs)
    set_._lab_precision = True
    return set_


def _in_precision(func):
    if getattr(func, "_lab_precision", False):
        return func
    theirs = getattr(func, "keywords", {}).get("context_fn")  # a functools.partial's, as transformers builds it

    @functools.wraps(func)
    def checkpoint_(function, *args, **kwargs):
        kwargs.update(use_reentrant=False, context_fn=_with_lab_contexts(kwargs.get("context_fn", theirs)))
        return func(function, *args, **kwargs)
    checkpoint_._lab_precision = True
    return checkpoint_


def _with_lab_contexts(theirs):
    if theirs is None:
        return contexts

    def both():
        (forward, recompute), (their_forward, their_recompute) = contexts(), theirs()
        return _entered(forward, their_forward), _entered(recompute, their_recompute)
    return both


@contextlib.contextmanager
def _entered(outer, inner):
    with outer, inner:
        yield

"""The shared loss-scaling engine: a drop-in replacement for ``torch.amp.GradScaler``.

The engine does what every policy needs and leaves only "what is the next scale?" to the policy:

* ``scale(outputs)`` multiplies by the FP32 scale tensor (lazily created on the outputs' device);
* ``unscale_(opt)`` unscales and checks all of the optimiser's gradients with one fused
  ``torch._amp_foreach_non_finite_check_and_unscale_`` call per (device, dtype), and computes the
  global grad norm on the device (``torch._foreach_norm``) and the unscaled gradients' absolute maximum
  (:func:`grads_amax`) when the policy asks for them;
* ``step(opt)`` does the step's single host synchronisation: it fetches the inf/nan flag (and the
  grad norm and maximum, stacked into the same tensor) and skips ``opt.step()`` on overflow;
* ``update()`` reuses the already fetched values (no second sync), asks the policy for the next
  scale, keeps the counters, and runs the two guards (alert, FP32 fallback).

Call-order rules, error types and messages follow ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import abc
from typing import Any, Iterable

import torch

from lab.core.fp16 import amaxes
from lab.core.shards import local_shard
from lab.scaling.adapters import FP16_TRAINABLE_FIX

from .base import ENGINE_PARAMS, ScalingConfigError, ScalingPolicy, check_engine_params, per_tensor_settings, to_f32
from .counters import COUNTER_KEYS, StepCounters
from .policies.deepspeed import ScaleFloorReached

__all__ = ["LossScaler", "ENGINE_PARAMS", "COUNTER_KEYS", "grads_amax"]


_READY, _UNSCALED, _STEPPED = 0, 1, 2
_FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."


class _OptState:
    """Per-optimiser bookkeeping for the current iteration."""

    __slots__ = ("stage", "found", "norm_sq", "flag", "own_flag", "norm_sq_value", "amax", "amax_value",
                 "shard_group")

    def __init__(self) -> None:
        self.stage = _READY
        self.found: dict[torch.device, torch.Tensor] = {}  # per-device found_inf tensors
        self.norm_sq: torch.Tensor | None = None  # on-device squared grad norm (unscaled)
        self.flag: bool | None = None  # host copy of found_inf, once synced
        self.own_flag: bool | None = None  # this rank's own found_inf before any agreement across ranks
        self.norm_sq_value: float | None = None
        self.amax: torch.Tensor | None = None  # on-device max |gradient| (unscaled)
        self.amax_value: float | None = None
        # sharded gradients (FSDP2's DTensors): each rank holds a shard, so found_inf, the maximum and the squared
        # norm are this rank's part until reduced over this process group (found/max: MAX, norm²: SUM)
        self.shard_group: Any = None


def grads_amax(grads: list[torch.Tensor]) -> torch.Tensor:
    """max |g| over ``grads`` (one device), as a 0-d FP32 tensor on that device, without a host synchronisation
    (NaN when a gradient holds NaN; lab.core.fp16.amaxes says how it is computed per device)."""
    return amaxes(grads).max()


class LossScaler(StepCounters):
    """A ``torch.amp.GradScaler``-compatible scaler whose scale rule is a :class:`ScalingPolicy`.

    Build one with ``lab.scaling.create(name, **params)``. Besides GradScaler's API it exposes:

    ``last_step_skipped``, ``last_found_inf`` (outcome of the last ``update()``), ``steps``,
    ``overflow_steps``, ``skipped_steps``, ``consecutive_skips``, ``max_consecutive_skips``,
    ``alerts``, ``fallback_step``, ``fp32_fallback``, ``last_grad_norm``, ``last_grad_amax``, ``update_ratio``.

    An iteration counts as *skipped* when any of its optimisers saw inf/nan and the policy skips
    overflow steps (or FP32 fallback is active). Guards: after ``alert_after`` consecutive skipped
    iterations a warning is logged on logger ``"lab.scaling"`` and ``alerts`` incremented (once per
    run of skips); after ``fp32_fallback_after`` consecutive skips ``fp32_fallback`` becomes True,
    ``fallback_step`` records the 0-based index of that ``update()`` call, the scale becomes 1.0
    and the policy is no longer consulted (non-finite steps are still skipped).
    """

    def __init__(self, policy: ScalingPolicy, *, device: str | torch.device | None = None, enabled: bool = True,
                 alert_after: int | None = 3, fp32_fallback_after: int | None = None, per_tensor: Any = None) -> None:
        if not isinstance(policy, ScalingPolicy):
            raise TypeError(f"policy must be a ScalingPolicy instance, got {policy!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:  # "cuda:1" or torch.device("cuda", 1) -> "cuda" (GradScaler takes the device type)
            device = torch.device(device).type
        except (TypeError, RuntimeError):
            raise ScalingConfigError(f"device must be a device type like 'cpu' or 'cuda', got {device!r}") from None
        check_engine_params(enabled, alert_after, fp32_fallback_after, per_tensor)
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available():
            warnings.warn("lab.scaling scaler is enabled with device='cuda', but CUDA is not available.  "
                          "Disabling.", stacklevel=2)
            self._enabled = False
        self.policy = policy
        self.alert_after = alert_after
        self.fp32_fallback_after = fp32_fallback_after
        # per-block factors on top of the loss scale (lab/scaling/pertensor.py); hooked into a model by
        # ``scaler.per_tensor.attach(model)``
        settings = per_tensor_settings(per_tensor)
        self.per_tensor = None
        if settings is not None:
            from .pertensor import PerBlockScaling
            self.per_tensor = PerBlockScaling(**settings)

        self._init_scale = float(policy.init_scale)
        self._scale: torch.Tensor | None = None  # FP32 scale tensor, created by the first scale()
        self._scale_value = to_f32(self._init_scale)  # host mirror of _scale (no sync needed)
        self._inv_value = reciprocal(self._scale_value)
        self._inv_cache: dict[torch.device, torch.Tensor] = {}
        self._one_cache: dict[torch.device, torch.Tensor] = {}
        self._opt_states: dict[int, _OptState] = {}

        self._reset_counters()  # steps, overflow_steps, skipped_steps, ... (lab/scaling/counters.py)
        self._agree_group: Any = None   # distributed: found_inf / grad norm agreed across this group's ranks
        self._agree = False
        self._shard_agree = True        # sharded gradients: agreed over the shards' group (decide_alone: off)
        self.last_found_inf_own = False  # the last step's found_inf from this rank's own gradients alone

    def agree_across_ranks(self, group: Any = None) -> None:
        """Distributed training: every step, agree found_inf (any rank's inf counts for all) and the grad norm
        (the largest) across the processes of ``group`` (None: the default group), with one small all-reduce
        inside the step's host synchronisation. DDP's all-reduce already makes replicated gradients equal;
        this covers gradients that are not all-reduced, and keeps the policy's state identical on every
        rank. (GradScaler leaves that to the user.) Sharded gradients (FSDP2's DTensors) are always agreed,
        over their mesh's group, with or without this call: found_inf and the maximum the largest rank's, the
        norm from the sum of the shards' squares (as ``ShardedGradScaler`` agrees found_inf)."""
        self._agree_group, self._agree = group, True

    def decide_alone(self) -> None:
        """A control, never for training: each rank decides a step's overflow from the gradients it holds, without
        any all-reduce (sharded: its own shard, after the reduce-scatter), as ``torch.amp.GradScaler`` does over
        FSDP1's flat shards (what ``ShardedGradScaler`` was written for). An inf in one rank's shard then skips the
        step on that rank only, and the ranks' scales, schedules and optimizer steps part: configs/fsdp-unscale.yaml
        measures how (docs/distributed.md). Undoes agree_across_ranks."""
        self._agree = self._shard_agree = False

    def _agreed(self, t: torch.Tensor, shard_group: Any = None) -> torch.Tensor:
        """The largest over ranks: of the agreement group (agree_across_ranks), or of the shards' group."""
        shard_group = shard_group if self._shard_agree else None
        if self._agree or shard_group is not None:
            import torch.distributed as dist
            group = shard_group if shard_group is not None else self._agree_group
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    # ------------------------------------------------------------------ info
    @property
    def policy_name(self) -> str | None:
        return self.policy.name

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """Current scale as a Python float (init scale before the first scale(); 1.0 when disabled).

        Unlike GradScaler this never synchronises: the engine keeps a host copy of the scale.
        """
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale_value

    def __repr__(self) -> str:
        return (f"LossScaler(policy={self.policy.name!r}, scale={self.get_scale()!r}, enabled={self._enabled}, "
                f"steps={self.steps}, skipped={self.skipped_steps}, fp32_fallback={self._fp32_fallback})")

    # ------------------------------------------------------------------ scale
    def _check_scale(self, funcname: str) -> torch.Tensor:
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _FIX)
        return self._scale

    def _lazy_init(self, dev: torch.device) -> torch.Tensor:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._scale_value = to_f32(self._init_scale)
        self._inv_value = reciprocal(self._scale_value)
        self._inv_cache = {}
        return self._scale

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples/iterables of tensors) by the scale."""
        if not self._enabled:
            return outputs
        if self.per_tensor is not None and not self.per_tensor.open:  # a step's first backward: new factors
            self.per_tensor.new_step(self._scale_value)
        if self.per_tensor is not None:  # the backward of what is scaled now is training's: observed
            self.per_tensor.armed = True
        if isinstance(outputs, torch.Tensor):
            scale = self._scale
            if scale is None:
                scale = self._lazy_init(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)

        per_device: dict[torch.device, torch.Tensor] = {}

        def apply_scale(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                dev = val.device
                s = per_device.get(dev)
                if s is None:
                    master = self._scale if self._scale is not None else self._lazy_init(dev)
                    s = per_device[dev] = master.to(device=dev, non_blocking=True, copy=True)
                return val * s
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _set_scale(self, value: float) -> None:
        value = to_f32(value)
        if value == self._scale_value:
            return
        self._scale_value = value
        self._inv_value = reciprocal(value)
        self._inv_cache = {}
        if self._scale is not None:
            self._scale.fill_(value)

    def _inv_for(self, dev: torch.device) -> torch.Tensor:
        t = self._inv_cache.get(dev)
        if t is None:
            # == scale.double().reciprocal().float(), computed on the host from the mirror
            t = self._inv_cache[dev] = torch.full((), self._inv_value, dtype=torch.float32, device=dev)
        return t

    def _one_for(self, dev: torch.device) -> torch.Tensor:
        t = self._one_cache.get(dev)
        if t is None:
            t = self._one_cache[dev] = torch.ones((), dtype=torch.float32, device=dev)
        return t

    # ------------------------------------------------------------------ unscale / step
    def _unscale_grads(self, optimizer: torch.optim.Optimizer, st: _OptState, allow_fp16: bool,
                       unscale: bool) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        fp16 = torch.float16
        if self.per_tensor is not None:  # each block's gradients back at the loss scale first (exact)
            self.per_tensor.to_loss_scale(self._scale_value)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    g = param.grad
                    if g is None:
                        continue
                    if g is not local_shard(g):  # a DTensor (FSDP2): this rank's shard, unscaled in place
                        st.shard_group = g.device_mesh.get_group()
                        g = local_shard(g)
                    if g.dtype == fp16 and not allow_fp16:
                        # torch's words first (users search for them), then the fix check_trainable_dtypes names
                        raise ValueError("Attempting to unscale FP16 gradients. Trainable parameters are FP16 (e.g. "
                                         f"LoRA adapters cast with a .half() base): {FP16_TRAINABLE_FIX}; "
                                         "lab.scaling.check_trainable_dtypes(model) names them before the first step.")
                    if g.is_sparse:
                        if g.dtype is fp16:
                            param.grad = g = g.coalesce()
                        g = g._values()
                    key = (g.device, g.dtype)
                    lst = groups.get(key)
                    if lst is None:
                        groups[key] = [g]
                    else:
                        lst.append(g)

            found = st.found = {}
            want_norm = self.policy.needs_grad_norm and not self._fp32_fallback
            want_amax = self.policy.needs_grad_amax and not self._fp32_fallback
            norm_parts: list[torch.Tensor] = []
            amax_parts: list[torch.Tensor] = []
            for (dev, _dtype), grads in groups.items():
                f = found.get(dev)
                if f is None:
                    f = found[dev] = torch.zeros((), dtype=torch.float32, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, f, self._inv_for(dev) if unscale else self._one_for(dev))
                if want_norm:
                    v = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
                    if not unscale:  # fused optimisers unscale themselves: these norms are still scaled
                        v = v * self._inv_for(dev)
                    norm_parts.append(torch.dot(v, v))
                if want_amax:
                    a = grads_amax(grads)
                    amax_parts.append(a if unscale else a * self._inv_for(dev))
            if want_amax:
                sdev = self._scale.device  # type: ignore[union-attr]
                st.amax = (torch.stack([a.to(sdev) for a in amax_parts]).max() if amax_parts
                           else torch.zeros((), dtype=torch.float32, device=sdev))
            if want_norm:
                sdev = self._scale.device  # type: ignore[union-attr]
                if norm_parts:
                    nsq = norm_parts[0].to(sdev)
                    for p in norm_parts[1:]:
                        nsq = nsq + p.to(sdev)
                else:
                    nsq = torch.zeros((), dtype=torch.float32, device=sdev)
                st.norm_sq = nsq

    def _opt_state(self, optimizer: torch.optim.Optimizer) -> "_OptState":
        """This iteration's state of ``optimizer`` (a fresh one, stage ready, on first use)."""
        st = self._opt_states.get(id(optimizer))
        if st is None:
            st = self._opt_states[id(optimizer)] = _OptState()
        return st

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimiser's gradients by the scale (in place) and record inf/nan, without a sync.

        Call it at most once per optimiser per iteration, after all gradients are accumulated and
        before clipping them.
        """
        if not self._enabled:
            return
        self._check_scale("unscale_")
        st = self._opt_state(optimizer)
        if st.stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif st.stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_grads(optimizer, st, allow_fp16=False, unscale=True)
        st.stage = _UNSCALED

    def _sync(self, states: list[_OptState]) -> None:
        """Fetch found_inf (and the squared grad norm) of ``states`` with one host synchronisation."""
        sdev = self._scale.device  # type: ignore[union-attr]
        parts: list[torch.Tensor] = []
        for st in states:
            fl = list(st.found.values())
            f = fl[0]
            if len(fl) > 1 or f.device != sdev:
                f = sum(t.to(sdev, non_blocking=True) for t in fl)  # type: ignore[assignment]
            parts.append(f)
            if st.norm_sq is not None:
                parts.append(st.norm_sq)
            if st.amax is not None:
                parts.append(st.amax)
        shard_group = next((st.shard_group for st in states if st.shard_group is not None), None)
        sharded = shard_group is not None and self._shard_agree
        if sharded or self._agree:
            mine = torch.stack([p.float() for p in parts])
            agreed = self._sharded(states, mine, shard_group) if sharded else self._agreed(mine.clone())
            # this rank's own values ride in the same transfer: its own found_inf, before the agreement
            vals = torch.cat([agreed, mine]).tolist()
            vals, own = vals[:len(parts)], vals[len(parts):]
        elif len(parts) == 1:
            vals = own = [parts[0].item()]
        else:
            vals = own = torch.stack(parts).tolist()
        i = 0
        for st in states:
            st.flag, st.own_flag = vals[i] != 0.0, own[i] != 0.0
            i += 1
            if st.norm_sq is not None:
                st.norm_sq_value = vals[i]
                i += 1
            if st.amax is not None:
                st.amax_value = vals[i]
                i += 1

    @staticmethod
    def _sharded(states: list[_OptState], t: torch.Tensor, group: Any) -> torch.Tensor:
        """The step's values (``t``, stacked) over every shard: found_inf and the maximum are the largest rank's, the
        squared norm the sum of the ranks' (the global norm is the square root of the sum of the shards' squares), in
        two small all-reduces inside the step's one host synchronisation."""
        import torch.distributed as dist
        is_norm = []
        for st in states:
            is_norm += [False] + ([True] if st.norm_sq is not None else []) + ([False] if st.amax is not None else [])
        mask = torch.tensor(is_norm, device=t.device)
        largest, total = torch.where(mask, torch.zeros_like(t), t), torch.where(mask, t, torch.zeros_like(t))
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        if any(is_norm):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return torch.where(mask, total, largest)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step(*args, **kwargs)`` unless the grads overflowed.

        Returns what ``optimizer.step`` returned (None when the step was skipped).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale("step")
        st = self._opt_state(optimizer)
        if st.stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, st, args, kwargs)

        if st.stage == _READY:
            self.unscale_(optimizer)
        if not st.found:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        self._sync([st])  # the step's one host synchronisation
        retval = None
        if not st.flag or not (self.policy.skip_on_overflow or self._fp32_fallback):
            retval = optimizer.step(*args, **kwargs)
        st.stage = _STEPPED
        return retval

    def _fused_step(self, optimizer: torch.optim.Optimizer, st: _OptState, args: tuple, kwargs: dict) -> Any:
        """Optimisers with ``_step_supports_amp_scaling`` (fused Adam/SGD) unscale and skip on device."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise RuntimeError("lab.scaling does not support the deprecated `grad_scaler` keyword protocol of "
                               f"{type(optimizer).__name__}.step(); use torch.amp.GradScaler for it.")
        if st.stage == _READY:
            self._unscale_grads(optimizer, st, allow_fp16=True, unscale=False)
        scale = self._scale
        assert scale is not None
        if st.found and (self.policy.skip_on_overflow or self._fp32_fallback):
            found: Any = self._agreed(sum(t.to(scale.device, non_blocking=True) for t in st.found.values()),
                                      st.shard_group)
        else:  # no record, or a policy that applies overflow steps anyway
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
        optimizer.grad_scale = (  # type: ignore[attr-defined]
            getattr(optimizer, "grad_scale", None) if st.stage == _UNSCALED
            else scale * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = found  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        st.stage = _STEPPED  # found_inf is fetched in update(), with the other pending flags
        return retval

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: pick the next scale (policy, or ``new_scale``), update counters and guards.

        Reuses the inf/nan flags fetched in ``step()``; syncs only for optimisers that were unscaled
        but not stepped (or stepped by a fused optimiser), all in one transfer.
        """
        if not self._enabled:
            return
        self._check_scale("update")
        recorded = [st for st in self._opt_states.values() if st.found]
        pending = [st for st in recorded if st.flag is None]
        if pending:
            self._sync(pending)
        index = self.steps

        found_inf = grew = False
        norm_sq = 0.0
        # what this rank's own gradients showed, before any agreement (distributed: another rank's inf may have
        # made found_inf; lab/run/train.py counts the steps at which the ranks' own checks differed)
        self.last_found_inf_own = any(st.own_flag for st in recorded)
        for st in recorded:
            if st.flag:
                found_inf = True
            if st.norm_sq_value is not None:
                norm_sq += st.norm_sq_value
        grad_norm = math.sqrt(norm_sq) if (recorded and recorded[0].norm_sq_value is not None) else None
        amaxes = [st.amax_value for st in recorded if st.amax_value is not None]
        # a NaN maximum (NaN gradients) is an overflow too: inf, so that max() cannot drop it
        grad_amax = max(math.inf if math.isnan(a) else a for a in amaxes) if amaxes else None
        if grad_amax is not None and found_inf:
            grad_amax = math.inf
        self.last_grad_amax = grad_amax
        if self.per_tensor is not None and recorded:
            self.per_tensor.end_step()

        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._set_scale(float(new_scale.reshape(()).item()))
            else:
                self._set_scale(float(new_scale))
        else:
            if not recorded:
                raise AssertionError("No inf checks were recorded prior to update.")
            if not self._fp32_fallback:
                before = self._scale_value
                try:
                    extra = {"grad_amax": grad_amax} if self.policy.needs_grad_amax else {}
                    self._set_scale(self.policy.update(self._scale_value, found_inf, index, grad_norm, **extra))
                except ScaleFloorReached:  # the policy ends the run here: the step counts, the iteration ends
                    self.steps = index + 1
                    self._record(index, found_inf, grad_norm)
                    self._opt_states = {}
                    raise
                grew = self._scale_value > before

        self.steps = index + 1
        if recorded:
            self._record(index, found_inf, grad_norm, grew=grew)
        else:
            self.last_found_inf = False
            self.last_step_skipped = False
        self._opt_states = {}

    def reset_scale(self, value: float) -> None:
        """Set the scale by hand while debugging (between iterations: after ``update()``). The policy keeps its
        state and goes on from the new scale; the change is recorded in ``scale_resets`` (the update index it
        took effect at, the scale before and after), which ``state_dict`` keeps and a recording's metrics list."""
        if self._opt_states:
            raise RuntimeError("reset_scale() is called between iterations: after update(), before scale()")
        try:
            new = float(value)
        except (TypeError, ValueError):
            raise ScalingConfigError(f"reset_scale: expected a positive finite number, got {value!r}") from None
        if not (math.isfinite(new) and new > 0 and math.isfinite(to_f32(new)) and to_f32(new) > 0):
            raise ScalingConfigError(f"reset_scale: expected a positive finite FP32 number, got {value!r}")
        old = self.get_scale()
        if self._scale is None:
            self._init_scale = new
        self._set_scale(new)
        self.scale_resets.append({"update": self.steps, "from": old, "to": self.get_scale()})

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``scale``, the policy's state (GradScaler's keys for ``dynamic``), ``policy`` and the counters.

        Empty when disabled. Call it after ``update()``.
        """
        if not self._enabled:
            return {}
        state: dict[str, Any] = {"scale": self.get_scale()}
        pstate = self.policy.state_dict()
        clash = set(pstate) & ({"scale", "policy"} | set(COUNTER_KEYS))
        if clash:
            raise RuntimeError(f"policy {self.policy.name!r} state keys clash with engine keys: {sorted(clash)}")
        state.update(pstate)
        state["policy"] = self.policy.name
        state.update(self._counters_state())
        if self.per_tensor is not None:
            state["per_tensor"] = self.per_tensor.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (a ``torch.amp.GradScaler`` one works for ``dynamic``).

        Missing counters start from zero. No-op when disabled.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        saved_policy = state_dict.get("policy")
        if saved_policy is not None and saved_policy != self.policy.name:
            raise ValueError(f"state_dict was saved by policy {saved_policy!r}, "
                             f"this scaler uses {self.policy.name!r}")
        try:
            self.policy.load_state_dict(state_dict)
            self._init_scale = float(state_dict["scale"])
        except KeyError as exc:
            raise ValueError(f"state_dict for policy {self.policy.name!r} lacks key {exc}; "
                             f"got keys {sorted(state_dict)}") from None
        self._set_scale(self._init_scale)
        self._load_counters(state_dict)
        if self.per_tensor is not None and "per_tensor" in state_dict:
            self.per_tensor.load_state_dict(state_dict["per_tensor"])

    def __getstate__(self) -> dict[str, Any]:
        if self._opt_states:
            raise AssertionError("A LossScaler instance may only be pickled at the beginning "
                                 "of an iteration, or at the end after scaler.update().")
        state = self.__dict__.copy()
        state["_init_scale"] = self.get_scale()
        state["_scale"] = None
        state["_inv_cache"] = {}
        state["_one_cache"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def reciprocal(s: float) -> float:
    """float32(1 / float64(s)) == torch's ``scale.double().reciprocal().float()``."""
    if s == 0.0:
        return math.copysign(math.inf, s)
    return to_f32(1.0 / s)

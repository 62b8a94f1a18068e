"""The forward-range rule of the diagnosis: the first module, in forward order, whose output left FP16's range.

On a replayed overflow step (lab/numerics/monitor.py: the lab's runs replay skipped overflow steps, a recorded loop
replays them with ``replay=``), or on the step after an overflow step in a loop recorded without a replay (its training
forward probed: lab/numerics/forward_range.py), every module's largest output magnitude is measured in the order the
modules finish their forward; steps.csv's ``forward_overflow_module`` / ``forward_overflow_type`` / ``forward_amax`` hold the first
one beyond 65504 (inf and NaN included). No loss scale reaches the forward pass: the cure is that module in FP32, or
bf16.
"""
from __future__ import annotations

import math
from collections import Counter

from lab.core.fp16 import MAX as FP16_MAX
from lab.diagnose import branch
from lab.diagnose.record import Diagnosis, _Builder, _Step

# Module classes whose operation autocast (CUDA and CPU) already runs in FP32 (torch.amp's FP32 op lists:
# layer_norm, group_norm, softmax, log_softmax, softmin, softplus, the losses, cosine_similarity): keeping them in
# FP32 changes nothing; a value beyond FP16's range reaches them from the operation before.
AUTOCAST_FP32 = ("LayerNorm", "GroupNorm", "Softmax", "LogSoftmax", "Softmin", "Softplus", "CrossEntropyLoss",
                 "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "KLDivLoss", "BCEWithLogitsLoss",
                 "CosineSimilarity", "PairwiseDistance")


def fmt_amax(x: float) -> str:
    return "NaN" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.4g}"


def forward_findings(b: _Builder, d: Diagnosis, steps: list[_Step], replayed: int | None, probed: int | None = None
                     ) -> None:
    """Name the first module beyond FP16's range on the replayed or probed steps; when a forward pass went
    non-finite and nothing was measured, say how to locate it."""
    rows = [s for s in steps if s.forward_module]
    how = ("replayed" if not probed else "probed (the forward after an overflow step)" if not replayed
           else "replayed or probed")
    if not rows:
        if d.precision == "fp16" and d.nonfinite_loss_steps and not replayed and not probed:
            d.notes.append("the module whose forward output left FP16's range was not located: no overflow step was "
                           "replayed (lab.record: pass replay=; a lab run replays the steps its policy skips, "
                           "policy none applies them)")
        return
    counts = Counter(s.forward_module for s in rows)
    module, n = counts.most_common(1)[0]
    first = next(s for s in rows if s.forward_module == module)
    kind = first.forward_type
    amaxes = [s.forward_amax for s in rows if s.forward_module == module]
    worst = next((a for a in amaxes if math.isnan(a)), None)
    worst = worst if worst is not None else max(amaxes)
    held = ("held NaN" if math.isnan(worst) else "held inf" if math.isinf(worst)
            else f"reached {fmt_amax(worst)} (beyond FP16's 65504)")
    others = ", ".join(f"{m} on {c}" for m, c in counts.most_common()[1:3])
    weights = max((s.forward_weight_amax for s in rows if s.forward_module == module), default=math.nan)
    heavy = weights > FP16_MAX  # inf included; NaN (not measured) is not
    d.forward_overflow = {"module": module, "type": kind, "steps": n, "first_step": first.step, "amax": worst,
                          "weight_amax": weights, "weights_beyond_fp16": heavy,
                          "replayed_steps": len(rows), "others": dict(counts.most_common()[1:3])}
    where = branch.label(d, module)  # a vision-language model's branch: ' in the vision branch (encoder)'
    if where:
        d.forward_overflow.update(branch=branch.branch(module), in_branch=where)
    b.find("forward_overflow", "problem",
           f"the forward pass left FP16's range first at {module} ({kind}){where}: its output {held} on {n} of the "
           f"{len(rows)} {how} steps that left it (first at step {first.step})"
           + (f"; elsewhere first: {others}" if others else "")
           + (f"; its own weights reach {fmt_amax(weights)}, beyond FP16's range" if heavy else ""),
           **d.forward_overflow)
    if heavy:  # the weights themselves: FP16 cannot hold them, so keeping the computation in FP32 is not enough
        how = ("they hold inf: their FP16 copy (a .half() model) overflowed, so load them from the FP32 checkpoint "
               "and keep them in FP32" if math.isinf(weights) else
               f"they reach {fmt_amax(weights)}, which autocast's FP16 cast of them overflows: keep the module in FP32")
        b.recommend("keep_fp32", f"Hold {module}'s weights in FP32 ({how}), or rescale them (fold the factor into the "
                    "next layer), or train in bf16 (FP32's range)",
                    f"{module} ({kind}) produced {held.removeprefix('held ').removeprefix('reached ')} from weights "
                    "beyond 65504", "forward_overflow", change={"precision": "bf16"})
    elif kind in AUTOCAST_FP32:
        b.recommend("keep_fp32", f"Keep the computation that feeds {module} in FP32 (autocast already runs {kind} in "
                    "FP32), or train in bf16 (FP32's range)",
                    f"{module} ({kind}) is computed in FP32 by autocast, and no module before it left FP16's range: "
                    "the value came from an operation outside a module just before it (a residual sum, an "
                    "activation written as a function)", "forward_overflow", change={"precision": "bf16"})
    else:
        b.recommend("keep_fp32", f"Keep {module} ({kind}) in FP32: call it under torch.autocast(device_type, "
                    "enabled=False) with its input .float(); or train in bf16 (FP32's range)",
                    f"its output {held} in the FP16 forward pass on {n} {how} steps; a loss scale acts on the "
                    "backward only", "forward_overflow", change={"precision": "bf16"})

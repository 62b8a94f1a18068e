"""Every predictor judged on recorded amax histories, as delayed scaling would have used it: at step t the scale
comes from the predictor over the steps before t (the last ``history_len`` of them, most recent first, zeros before
the first, as Transformer Engine's history starts), ``scale = max_value / predicted / 2^margin`` (1 with nothing
observed, TE's initial scale). Per step:

* **clipped**: the tensor's amax times the scale exceeds the format's largest value: its largest values saturate
  (what current scaling never does: it scales from the step's own amax);
* **unused binades**: log2(max_value / (amax * scale)) where it did not clip: how far under the format's top the
  tensor's largest value sits, the range lost at the bottom (flushed values) against current scaling, which uses
  all of it.

Exact given the recorded amaxes; what the shares of saturated and flushed values become needs the tensors
themselves (the studies' training runs count them on census steps). A predictor's prediction over a recorded
history does not change the history (the amax of a tensor does not depend on its own scale, but the training that
follows does: second order, as the FP16 replay's skipped steps)."""
from __future__ import annotations

import math

import torch

from lab.scaling.predictors import create_predictor

JUDGE_COLUMNS = ("predictor", "history_len", "margin", "role", "tensors", "steps", "clipped_pct",
                 "unused_binades", "exceeded_pct")


def predictions_over(amax: torch.Tensor, predictor, history_len: int) -> torch.Tensor:
    """The predicted amax used at every step of one sequence (oldest first): (steps,), 0 where nothing was
    observed before the step."""
    n = len(amax)
    padded = torch.cat([torch.zeros(history_len, dtype=amax.dtype), torch.nan_to_num(amax, nan=0.0)])
    idx = torch.arange(n).unsqueeze(1) + history_len - 1 - torch.arange(history_len).unsqueeze(0)
    return predictor(padded[idx])  # row t: steps t-1, t-2, ... (most recent first)


def _hybrid_max() -> dict[str, float]:
    """Each role's format maximum under TE's HYBRID format (E4M3 forward, E5M2 gradients), from torch.finfo."""
    e4m3, e5m2 = (float(torch.finfo(d).max) for d in (torch.float8_e4m3fn, torch.float8_e5m2))
    return {"input": e4m3, "weight": e4m3, "grad_output": e5m2}


def judge(histories, spec, history_len: int, margin: int = 0) -> list[dict]:
    """One row per role (and "all") for one predictor over the histories (lab/scaling/learning/histories.py),
    under the HYBRID format's maxima (only the steps before any observation depend on them: scale 1)."""
    predictor = create_predictor(spec, history="fp8")
    maxima = _hybrid_max()
    sums: dict[str, list] = {}
    for h in histories:
        a, max_value = h.amax, maxima.get(h.role, maxima["input"])
        pred = predictions_over(a, predictor, history_len)
        ok = torch.isfinite(a) & (a > 0)
        scale = torch.where(pred > 0, max_value / pred / 2.0 ** margin, torch.ones_like(pred))
        top = a * scale
        clipped = (top > max_value) & ok
        unused = torch.log2(max_value / top)
        exceeded = (a > pred) & ok & (pred > 0)
        for role in (h.role, "all"):
            s = sums.setdefault(role, [0, 0, 0, 0.0, 0, 0])
            s[0] += 1
            s[1] += int(ok.sum())
            s[2] += int(clipped.sum())
            s[3] += float(unused[ok & ~clipped].sum())
            s[4] += int((ok & ~clipped).sum())
            s[5] += int(exceeded.sum())
    name = repr(predictor)
    return [{"predictor": name, "history_len": history_len, "margin": margin, "role": role, "tensors": s[0],
             "steps": s[1], "clipped_pct": 100.0 * s[2] / s[1] if s[1] else math.nan,
             "unused_binades": s[3] / s[4] if s[4] else math.nan,
             "exceeded_pct": 100.0 * s[5] / s[1] if s[1] else math.nan} for role, s in sorted(sums.items())]

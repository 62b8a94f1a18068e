"""The advice rules of the diagnosis: which replayed policy to offer, recommendations the run's own evidence
contradicts (withheld, with the reason), their order, and the verdict.

The rules (docs/diagnose.md, "Rules of advice"; tests/test_diagnose_catalogue.py tests each):

1. Never recommend a policy, precision or setting the run already used, nor a loss scale at or above one the run
   overflowed at with a finite loss (an init_scale: at or above one its initial overflow streak overflowed at): the
   evidence says it fails.
2. Never offer a replayed policy whose replay is uncertain on most steps, or whose gain would vanish if the steps its
   replay cannot judge overflowed, or one that applies overflowed gradients (it "skips fewer" by not skipping).
3. When the model, not the scale, is the problem (a non-finite forward pass, a module beyond FP16's range, overflow
   at every scale or at scale <= 1), that comes first: in the findings, the headline and the recommendations.
4. Recommendations are ranked by the findings they rest on: the model's problems first (a lower learning rate
   first among them: weights that blew up explain a forward pass beyond FP16's range), then problem, warning, info.
5. Precision is not advised as the cure (bf16, a module kept in FP32, an FP32 fallback) where the loss was
   non-finite in FP32 as well (after an FP32 fallback) or rose before it went non-finite (a divergence FP32 would
   show too).
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.diagnose.record import (HEALTHY_UPDATE_RATIO, SEVERITIES, Diagnosis, Finding, Recommendation, _Builder,
                                 _pct, _Step, fmt_scale)

#: how much more of the parameter gradients (a share) a replayed policy may flush and still be recommended
REPLAY_FLUSH_SLACK = 1e-3
#: findings that say the model (its forward pass or its values), not the loss scale, is the problem
MODEL_CAUSES = ("forward_overflow", "loss_nonfinite", "overflow_every_scale", "overflow_at_low_scale")
GENERIC = ("diverged", "failed", "overflow", "low_update_ratio")   # specific causes first within a severity
#: findings that explain a non-finite loss before the model's causes do: NaN began in a quantizer (lab/diagnose/fp8.py)
EXPLAINS_NONFINITE = ("fp8_infinite_scale",)
SAME_RULE = {"torch.amp.GradScaler": "dynamic"}   # a recording's scaler -> the lab policy with its rule (tested)


def replay_findings(b: _Builder, d: Diagnosis, run_dir: Path) -> None:
    """An FP16 run that skipped steps: which registered policy, replayed over this run (lab/diagnose/replay.py),
    would have skipped fewer without flushing more of the parameter gradients. Not when a loss was non-finite (no
    loss scale helps a forward pass that overflowed) or the run fell back to FP32; never a policy that applies
    overflowed steps or whose replay is uncertain on most steps (rule 2)."""
    if d.precision != "fp16" or not d.skipped_steps or d.nonfinite_loss_steps or d.fallback_step is not None:
        return
    from lab.diagnose.replay import ReplayError, replay_run
    try:
        rows = [r for r in replay_run(run_dir) if r["ended_at"] is None]
    except ReplayError:  # a run recorded before grad_amax: nothing to replay
        return
    mine = SAME_RULE.get(d.policy, d.policy)
    own = next((r for r in rows if r["policy"] == mine), None)
    own_flush = (own or {}).get("flushed_param") or 0.0
    fewer = [r for r in rows if r["skipped_steps"] < d.skipped_steps and r["policy"] != mine
             and (r["flushed_param"] or 0.0) <= own_flush + REPLAY_FLUSH_SLACK]
    # its gain must hold even if every step its replay cannot judge overflowed (a step the run overflowed at a
    # higher scale than the policy's: unknown below it)
    unsure = [r["policy"] for r in fewer if _unsure(r, d.skipped_steps)]
    applies = [r["policy"] for r in fewer if _applies_overflows(r) and r["policy"] not in unsure]
    better = sorted((r for r in fewer if r["policy"] not in unsure and r["policy"] not in applies),
                    key=lambda r: (r["skipped_steps"], r["flushed_param"] or 0.0))
    why = ([f"{', '.join(unsure)} (its replay is uncertain on the steps that would make it skip fewer)"] if unsure
           else []) + ([f"{', '.join(applies)} (applies overflowed gradients instead of skipping)"] if applies else [])
    if why:
        d.notes.append("replayed policies not offered: " + "; ".join(why))
    if not better:
        return
    text = ", ".join(f"{r['policy']} {r['skipped_steps']}" for r in better[:3])
    b.find("replay_fewer_skips", "info", f"replayed over this run's gradients (python -m lab replay), these "
           f"policies at their defaults skip fewer steps than this run's {d.skipped_steps}: {text}",
           policies={r["policy"]: r["skipped_steps"] for r in better})
    best = better[0]
    b.recommend("replay_policy", f"Try policy {best['policy']} (replay: {best['skipped_steps']} skipped steps "
                f"instead of {d.skipped_steps}, uncertain on {best.get('uncertain_steps', 0)})",
                f"replayed, it flushes {_pct(best['flushed_param'] or 0.0)} of the parameter gradients against "
                f"{_pct(own_flush)} for {d.policy}; replay is exact for the policy's rule and an approximation for "
                "the run (docs/replay.md)", "replay_fewer_skips", change={"policy": best["policy"]})


def _unsure(row: dict, run_skipped: int) -> bool:
    unknown = row.get("uncertain_steps") or 0
    return 2 * unknown > max(row.get("steps") or 0, 1) or row["skipped_steps"] + unknown >= run_skipped


def _applies_overflows(row: dict) -> bool:
    return (row.get("overflow_steps") or 0) > (row.get("skipped_steps") or 0)


def contradiction(rec: Recommendation, d: Diagnosis, fp16_rows: list[_Step], scaler_cfg: dict,
                  nonfinite: Finding | None = None) -> str | None:
    """Why the run's own evidence contradicts ``rec`` (rule 1), or None. ``nonfinite``: the loss_nonfinite finding."""
    ch = rec.change
    overflowed = sorted({s.scale for s in fp16_rows if s.found_inf and math.isfinite(s.loss)})
    if ch.get("policy") is not None and ch["policy"] == SAME_RULE.get(d.policy, d.policy):
        return f"this run already used policy {d.policy}"
    if ch.get("precision") is not None and ch["precision"] == d.precision:
        return f"this run already trained in {d.precision}"
    if (ch.get("precision") is not None or ch.get("fp32_fallback_after") is not None) and nonfinite is not None:
        if nonfinite.evidence.get("after_fallback"):
            return "the loss was non-finite in FP32 too, after the fallback: precision is not the cause"
        if nonfinite.evidence.get("diverging"):
            return ("the loss rose before it became non-finite: the weights grew past FP16's range, a divergence "
                    "FP32 would show too")
    if ch.get("fp32_fallback_after") is not None and scaler_cfg.get("fp32_fallback_after") is not None:
        return f"this run already had fp32_fallback_after {scaler_cfg['fp32_fallback_after']}"
    # a scale kept for the whole run fails where any step overflowed; an initial scale only where the start did
    at_start = sorted({s.scale for s in fp16_rows[:d.initial_overflow_streak] if math.isfinite(s.loss)})
    for key, seen in (("scale", overflowed), ("init_scale", at_start)):
        x = ch.get(key)
        if x is None:
            continue
        at_or_below = [s for s in seen if s <= x]
        if at_or_below:
            return (f"it would set {key} {fmt_scale(x)}, and this run overflowed at {fmt_scale(at_or_below[0])} "
                    "with a finite loss")
        if key == "scale" and d.policy == "static" and d.init_scale == x:
            return f"this run already used the static scale {fmt_scale(x)}"
    x = ch.get("scale_above")
    if x is not None and any(x < s <= 2 * x for s in overflowed):
        return f"this run overflowed one doubling above {fmt_scale(x)}: there is no room to raise it"
    return None


def check_advice(b: _Builder, d: Diagnosis, fp16_rows: list[_Step], scaler_cfg: dict) -> None:
    """Withhold what the evidence contradicts (rule 1, into ``d.withheld``), then rank (rules 3 and 4)."""
    kept = []
    nonfinite = next((f for f in b.findings if f.code == "loss_nonfinite"), None)
    model_cause = next((f.code for f in b.findings if f.code in MODEL_CAUSES), None)
    fp8_nan = next((f for f in b.findings if f.code in EXPLAINS_NONFINITE), None)
    for rec in b.recs:
        why = contradiction(rec, d, fp16_rows, scaler_cfg, nonfinite)
        if why is None and fp8_nan is not None and rec.based_on and all(c in MODEL_CAUSES for c in rec.based_on):
            # the NaN began in an FP8 cast (an infinite scale), not in the model's weights or range
            why = (f"the non-finite values began in an FP8 cast ({fp8_nan.code}: {fp8_nan.evidence.get('layer')} at "
                   f"step {fp8_nan.evidence.get('step')}), not in the model's weights or range")
        if why is None and model_cause and rec.code == "raise_scale":
            # the census was taken at a scale the model's overflows drove down: a higher one overflows again
            why = (f"the model, not the scale, is the problem ({model_cause}): the scale is as low as the overflows "
                   "drove it, and a higher one would overflow again")
        if why is None:
            kept.append(rec)
        else:
            d.withheld.append({"code": rec.code, "action": rec.action, "reason": why})
    severity = {f.code: SEVERITIES.index(f.severity) for f in b.findings}

    def rank(rec: Recommendation) -> tuple:
        # weights that blew up (lower_lr) explain a forward pass beyond FP16's range, not the other way round;
        # an FP8 cast that made NaN explains a non-finite loss before either
        first = any(c in EXPLAINS_NONFINITE for c in rec.based_on)
        model = any(c in MODEL_CAUSES for c in rec.based_on)
        return (not first, not model, rec.code != "lower_lr",
                min((severity.get(c, len(SEVERITIES)) for c in rec.based_on), default=len(SEVERITIES)))
    b.recs = sorted(kept, key=rank)


def sort_findings(b: _Builder) -> None:
    """Problems first; within a severity a divergence (the loss rose, then went non-finite: it explains the rest),
    the model's problems, then specific causes, then the generic ones."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    b.findings.sort(key=lambda f: (order[f.severity], f.code not in EXPLAINS_NONFINITE, not _diverging(f),
                                   f.code not in MODEL_CAUSES, f.code in GENERIC))


def _diverging(f: Finding) -> bool:
    return f.code == "loss_nonfinite" and bool(f.evidence.get("diverging"))


def underflow_note(d: Diagnosis) -> str:
    """What a healthy FP16 run's underflow is: the FP32 replay's numbers, or that it was not measured."""
    if d.fp16_loss:
        from lab.diagnose.underflow import FLUSH_MATERIAL
        worst = max(v["flushed"] for v in d.fp16_loss["sources"].values())
        return (f" (FP16 flushed at most {_pct(worst)} of the gradients FP32 keeps, under the "
                f"{_pct(FLUSH_MATERIAL)} that the study's losses point to: docs/census.md)")
    if d.precision == "fp16":
        return " (underflow not measured: an FP32 replay of the census steps would say what FP16 flushed)"
    return ""


def verdict(b: _Builder, d: Diagnosis, metrics: dict) -> None:
    """The verdict and the headline; a healthy run is told so first."""
    issues = [f for f in b.findings if f.severity in ("problem", "warning")]
    if d.status == "failed":
        d.verdict = "failed"
    elif d.status == "diverged" or metrics.get("diverged"):
        d.verdict = "diverged"
    elif not issues and d.steps and d.update_ratio > HEALTHY_UPDATE_RATIO:
        d.verdict = "healthy"
    else:
        d.verdict = "issues"
    # a healthy run is told there is nothing to change, unless FP16 lost gradients a higher scale would keep
    # (advice from the FP32 replay, below the warning level); other info-level advice is counterfactual
    advised = any("fp16_underflow" in r.based_on or r.action.startswith("Optional") for r in b.recs)
    if d.verdict == "healthy" and not advised:
        b.recs = [Recommendation("healthy", "Nothing to change",
                                 f"{_pct(d.update_ratio)} of {d.steps} steps updated the weights (healthy: > "
                                 f"{_pct(HEALTHY_UPDATE_RATIO)}) and no finding is a problem or a warning"
                                 + underflow_note(d))] + b.recs
        d.headline = f"healthy: {_pct(d.update_ratio)} of {d.steps} steps updated the weights"
    elif d.verdict == "healthy" and d.fp16_loss:
        d.headline = (f"healthy: {_pct(d.update_ratio)} of {d.steps} steps updated the weights; FP16 flushed "
                      f"{_pct(max(v['flushed'] for v in d.fp16_loss['sources'].values()))} of the gradients FP32 "
                      "keeps, which a higher loss scale would keep")
    elif d.verdict == "healthy":
        d.headline = (f"healthy: {_pct(d.update_ratio)} of {d.steps} steps updated the weights; optional: "
                      f"{b.recs[0].action.split(': ', 1)[-1]}")
    else:
        reason = (f" ({d.diverged_reason})" if d.verdict == "diverged" and d.diverged_reason else
                  f" ({metrics.get('error')})" if d.verdict == "failed" and metrics.get("error") else "")
        top = next((f for f in issues if f.code not in ("diverged", "failed")), None)
        model = ("the model, not the loss scale: " if top is not None and top.code in MODEL_CAUSES
                 and not _diverging(top) else "")
        d.headline = f"{d.verdict}{reason}: " + (f"{model}{top.message}" if top else
                                                  f"{_pct(d.update_ratio)} of steps updated the weights")

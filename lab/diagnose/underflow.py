"""The underflow rules of the diagnosis: what census.csv says about FP16's range (lab/diagnose/ runs them).

What FP16 lost, measured: an FP16 run's FP32 replay of its census steps (rows with ``grads`` "fp32"), or an FP32 or
bf16 run's counterfactual census (what FP16 would lose at each scale). An FP16 run without the replay cannot tell a
flushed value from a true zero: its underflow is *unknown* (never 0%), and a census whose gradients are (nearly) all
exactly zero, or hold no normal value, is flagged. Also the layers with values beyond FP16's range, and which loss
scale (or bf16) the census points to.
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from lab.core.fp16 import SMALLEST_SUBNORMAL
from lab.diagnose.record import CENSUS_COLUMNS, CENSUS_TOTAL, Diagnosis, _Builder, _pct, fmt_scale, fmt_scale_value
from lab.numerics.census import replay_rows

ACT = "activation_grad"

UNDERFLOW_LARGE = 0.01           # >= 1 % of a tensor class's values flush to zero in FP16
ZERO_MOST = 0.99                 # an FP16 census with >= 99 % of a tensor class exactly zero: flushed, most likely
# An FP16 run's FP32 replay (docs/census.md, "What FP16 lost", has the study's runs these were read from):
FLUSH_MATERIAL = 0.20   # FP16 flushed >= 20 % of the gradient values FP32 keeps non-zero: not healthy
SUBNORMAL_MOST = 0.95   # or kept >= 95 % of them only as subnormals (under 11 significant bits)
FLUSH_TARGET = 0.01     # the raised scale should flush under 1 % ...
# Precision lost, not only values: an FP16 subnormal in [2^k, 2^(k+1)) keeps k + 25 significant bits, so a value
# under 2^(COARSE_TOP + 1) keeps fewer than BF16's 8 (FP16's smallest subnormal 2^-24, BF16's eps 2^-7): "coarse",
# flushed values included. Material from COARSE_MATERIAL of what FP32 keeps: of a sample of the default study's runs
# (results/benchmarks/precision_lost.md, docs/census.md) those equivalent to FP32 held up to 44% that coarsely (LM
# fp16-static128), those not resolved up to 68% (ViT fp16-noscale), the LM's fp16-noscale (cost resolved) 97%.
COARSE_MATERIAL = 0.80
COARSE_TOP = (int(math.log2(SMALLEST_SUBNORMAL))
              + (1 - int(math.log2(torch.finfo(torch.bfloat16).eps))) - 2)   # -18: bins k <= -18 hold < 8 bits
HEADROOM_TOP = 15       # ... and keep the largest scaled gradient under 2^15 (half of FP16's range, one
                        # doubling of margin below 65504)


def census_findings(b: _Builder, d: Diagnosis, census: list[dict], hist: list[dict] | None = None) -> None:
    """Summarise the latest census step into d.census, then find underflow and overflow and advise a scale.

    An FP16 run's census holds its own FP16 rows and, on replayed steps, FP32 rows (grads "fp32"): what FP16
    lost is read from those (fp16_loss_findings); the older rules read the run's own rows."""
    replay = replay_rows(census) if d.precision == "fp16" else []
    if d.precision == "fp16":
        census = [r for r in census if r.get("grads") in (None, "fp16")]
    if replay:
        fp16_loss_findings(b, d, census, replay, hist or [])
    if census:
        _own_census_findings(b, d, census, skip_underflow=bool(replay))


def _own_census_findings(b: _Builder, d: Diagnosis, census: list[dict], skip_underflow: bool) -> None:
    last = max(r["step"] for r in census)
    rows = [r for r in census if r["step"] == last]
    counterfactual = d.precision != "fp16"
    table = _census_table(rows)
    target = 1.0 if counterfactual or d.final_scale is None else d.final_scale
    if not (target > 0 and math.isfinite(target)):
        target = 1.0
    at_final = {src: _nearest(list(t), target) for src, t in table.items()}
    d.underflow_at_final_scale = {src: table[src][at]["underflow_frac"] for src, at in at_final.items()}
    ovf_layers, ovf_from = _overflow_layers(census)
    d.census = {"step": last, "counterfactual": counterfactual,
                "table": {src: {f"{at:g}": v for at, v in t.items()} for src, t in table.items()},
                "underflow_layers": _underflow_layers(rows, at_final),
                "overflow_layers": dict(ovf_layers.most_common(3))}

    worst_src = max(d.underflow_at_final_scale, key=d.underflow_at_final_scale.get)
    if skip_underflow:  # the FP32 replay measured it (fp16_loss_findings); FP16's own zeros hide the flushed
        _overflow_census(b, ovf_layers, ovf_from)
        return
    if not counterfactual:  # FP16's own values: a flushed gradient is a zero like any other, so nothing measured
        d.underflow_at_final_scale = None
        _unmeasured_underflow(b, d, table, at_final, last)
        _overflow_census(b, ovf_layers, ovf_from)
        return
    _underflow_finding(b, d, table, at_final[worst_src], worst_src)
    _overflow_census(b, ovf_layers, ovf_from)
    _scale_advice(b, d, table, at_final[worst_src], worst_src)


def _unmeasured_underflow(b: _Builder, d: Diagnosis, table: dict, at_final: dict[str, float], last: int) -> None:
    """An FP16 census without its FP32 replay: underflow unknown. Gradients (nearly) all exactly zero, or with no
    normal value left, are flagged: that is what a flushed backward looks like."""
    shares = {src: table[src][at] for src, at in at_final.items()}
    zeros = {src: c["zero_frac"] for src, c in shares.items()}
    no_normal = [src for src, c in shares.items() if c["normal"] == 0 and c["total"] > c["zero"]]
    said = "; ".join(f"{src.replace('_', ' ')}s {_pct(z)} exactly zero" + (
        ", the rest all subnormal" if src in no_normal else "") for src, z in zeros.items())
    flushed = [src for src, z in zeros.items() if z >= ZERO_MOST] + [s for s in no_normal if zeros[s] < ZERO_MOST]
    scale = next(iter(at_final.values()))
    how = ("pass replay= to lab.record (an FP32 replay of each census step counts what FP16 flushed)"
           if d.recording else "turn on the census's FP32 replay (train.census_fp32_replay)")
    if not flushed:
        b.find("underflow_unknown", "info", f"underflow not measured: FP16's own gradients hold flushed values as "
               f"zeros (census step {last}, scale {fmt_scale(scale)}: {said}, flushed values included); to measure "
               f"it, {how}", zero_share=zeros, census_step=last)
        return
    b.find("grads_flushed", "problem", f"at scale {fmt_scale(scale)} the FP16 gradients are (nearly) all lost "
           f"(census step {last}: {said}): FP16 flushed the backward to zero; only an FP32 replay can say how much "
           f"of it was a true zero ({how})", zero_share=zeros, no_normal=no_normal, census_step=last, scale=scale)
    if d.overflow_steps == 0:
        b.recommend("raise_scale", "Use a higher loss scale: dynamic scaling (it grows the scale until a step "
                    f"overflows), or a static scale well above {fmt_scale(scale)}",
                    f"{said} at scale {fmt_scale(scale)}, and no step overflowed: the range has room above",
                    "grads_flushed", change={"scale_above": scale})
    else:
        b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed)",
                    f"{said} at scale {fmt_scale(scale)} while {d.overflow_steps} steps overflowed: FP16's range is "
                    "too narrow at both ends", "grads_flushed", change={"precision": "bf16"})
    b.recommend("measure_underflow", f"Measure what FP16 flushes: {how}",
                "FP16's own zeros cannot tell flushed values from true zeros", "grads_flushed")


def _overflow_census(b: _Builder, ovf_layers: Counter, ovf_from: dict) -> None:
    if ovf_layers:
        b.find("census_overflow_layers", "info", "values beyond FP16's range in the census: " + ", ".join(
               f"{k} ({v} values, from scale {fmt_scale(ovf_from[k])})" for k, v in ovf_layers.most_common(3)),
               layers=dict(ovf_layers.most_common(3)))


def _census_table(rows: list[dict]) -> dict[str, dict[float, dict]]:
    """source -> at_scale -> counts and fractions (the __total__ row, else the sum over layers)."""
    table: dict[str, dict[float, dict]] = {}
    for source in sorted({r["source"] for r in rows}):
        for at in sorted({r["at_scale"] for r in rows if r["source"] == source}):
            sel = [r for r in rows if r["source"] == source and r["at_scale"] == at]
            tot = [r for r in sel if r["layer"] == CENSUS_TOTAL]
            use = tot[:1] if tot else sel
            counts = {c: sum(r[c] for r in use) for c in CENSUS_COLUMNS[5:]}
            t = counts["total"] or 1
            counts.update(underflow_frac=counts["underflow"] / t, overflow_frac=counts["overflow"] / t,
                          subnormal_frac=counts["subnormal"] / t, zero_frac=counts["zero"] / t)
            table.setdefault(source, {})[at] = counts
    return table


def _nearest(ats: list[float], target: float) -> float:
    """The recorded scale nearest to target, in powers of two."""
    return min(ats, key=lambda a: abs(math.log2(a) - math.log2(target)) if a > 0 else math.inf)


def _underflow_layers(rows: list[dict], at_final: dict[str, float]) -> dict[str, float]:
    """The three layers with the highest underflow fraction at the final scale (over all sources), highest first."""
    layer_uf: dict[str, float] = {}
    for r in rows:
        if r["layer"] != CENSUS_TOTAL and r["at_scale"] == at_final.get(r["source"]) and r["total"]:
            f = r["underflow"] / r["total"]
            if f > layer_uf.get(r["layer"], 0.0):
                layer_uf[r["layer"]] = f
    return dict(sorted(((k, v) for k, v in layer_uf.items() if v > 0), key=lambda kv: -kv[1])[:3])


def _overflow_layers(census: list[dict]) -> tuple[Counter, dict[str, float]]:
    """Values beyond FP16's range per layer over every census step, and the smallest scale each was seen at."""
    ovf_layers, ovf_from = Counter(), {}
    for r in census:
        if r["layer"] != CENSUS_TOTAL and r["overflow"]:
            ovf_layers[r["layer"]] += r["overflow"]
            ovf_from[r["layer"]] = min(ovf_from.get(r["layer"], math.inf), r["at_scale"])
    return ovf_layers, ovf_from


def _describe(table: dict[str, dict[float, dict]], at: float) -> str:
    """The underflow fraction of each tensor class recorded at scale at, e.g. "activation grads 2.0%"."""
    return ", ".join(f"{src.replace('_', ' ')}s {_pct(table[src][at]['underflow_frac'])}"
                     for src in table if at in table[src])


def _underflow_finding(b: _Builder, d: Diagnosis, table: dict, at: float, worst_src: str) -> None:
    """An FP32/bf16 run's counterfactual census: how much FP16 would flush at scale ``at`` (advice for FP16, not a
    problem of this run)."""
    last, layers = d.census["step"], d.census["underflow_layers"]
    layer_txt = ("; most in " + ", ".join(f"{k} ({_pct(v)})" for k, v in layers.items())) if layers else ""
    msg = (f"in FP16 at scale {fmt_scale(at)}, {_describe(table, at)} of values would flush to zero "
           f"(counterfactual census of this {d.precision} run, step {last}){layer_txt}")
    b.find("underflow", "info", msg, underflow_at_final_scale=d.underflow_at_final_scale, at_scale=at,
           census_step=last, layers=dict(layers))


def _scale_advice(b: _Builder, d: Diagnosis, table: dict, at: float, worst_src: str) -> None:
    """Which loss scale (or bf16) an FP32/bf16 run's counterfactual census points to."""
    worst = d.underflow_at_final_scale[worst_src]
    all_ats = sorted({a for t in table.values() for a in t})
    if len(all_ats) > 1:
        _counterfactual_scale_advice(b, table, all_ats, d.census["step"], at, worst)


def _counterfactual_scale_advice(b: _Builder, table: dict, all_ats: list[float], last: int, at: float,
                                 worst: float) -> None:
    """An FP32/bf16 run's census at several scales: the largest that fits FP16's range, or bf16 if none does."""
    fits = [a for a in all_ats if all(t[a]["overflow"] == 0 and t[a]["underflow_frac"] < UNDERFLOW_LARGE
                                      for t in table.values() if a in t)]
    # at every recorded scale some tensor class loses >= 1 % to underflow
    every = all(any(t[a]["underflow_frac"] >= UNDERFLOW_LARGE for t in table.values() if a in t)
                for a in all_ats)
    per_scale = "; ".join(f"{fmt_scale(a)}: {_describe(table, a)} under, "
                          f"{max(t[a]['overflow_frac'] for t in table.values() if a in t):.2%} over"
                          for a in all_ats)
    if every or not fits:
        b.find("no_fp16_scale_fits", "info", f"no recorded scale keeps FP16 underflow below "
               f"{_pct(UNDERFLOW_LARGE)} without overflow ({per_scale})", per_scale=per_scale)
        b.recommend("bf16", "For reduced precision, train in bf16 rather than FP16 (FP32's range; no loss "
                    "scale needed)", f"counterfactual census at step {last}: {per_scale}", "no_fp16_scale_fits",
                    change={"precision": "bf16"})
    elif worst >= UNDERFLOW_LARGE:
        best = fits[-1]
        b.recommend("raise_scale", f"For FP16 training: a loss scale near {fmt_scale_value(best)} (static) or "
                    "dynamic scaling, not scale 1",
                    f"at scale 1 {_describe(table, at)} of values would flush to zero; at {fmt_scale(best)} "
                    f"{_describe(table, best)} and nothing overflows", "underflow", change={"scale": best})


# --- an FP16 run's FP32 replay: what FP16 lost -------------------------------------------------------------
def _totals(rows: list[dict], step: int) -> dict[str, dict]:
    """source -> the counts of one census step at its one scale (the __total__ row, else the sum over layers)."""
    return {src: next(iter(t.values())) for src, t in _census_table([r for r in rows if r["step"] == step]).items()}


def _lost(own: dict | None, rep: dict) -> dict:
    """Of the values FP32 holds non-zero: the share FP16 held as zero (flushed, the loss of earlier layers
    included), the share FP16 would flush on its own (direct) and the share left subnormal."""
    keep = rep["total"] - rep["zero"]
    if not keep:
        return {"flushed": 0.0, "direct": 0.0, "subnormal": 0.0, "kept_by_fp32": 0}
    if own and own["total"] != rep["total"]:
        # not the same values counted (a recording from before lab.record told micro-batches apart counted every
        # micro-batch's FP16 zeros against one replayed micro-batch): FP16's own zeros cannot be compared, so the
        # share is what the replay alone says flushes
        own = None
    flushed = max(0, own["zero"] - rep["zero"]) / keep if own else rep["underflow"] / keep
    # own zeros <= own total == replay total: the share cannot pass 100% when both count the same values
    assert 0.0 <= flushed <= 1.0, (own, rep)
    return {"flushed": flushed, "direct": rep["underflow"] / keep, "subnormal": rep["subnormal"] / keep,
            "kept_by_fp32": keep}


def _layer_losses(own: list[dict], replay: list[dict], step: int, source: str) -> dict[str, float]:
    """The three layers whose gradients FP16 flushed most (share of what FP32 keeps), highest first."""
    mine = {r["layer"]: r for r in own if r["step"] == step and r["source"] == source}
    out = {}
    for r in replay:
        if r["step"] == step and r["source"] == source and r["layer"] != CENSUS_TOTAL:
            loss = _lost(mine.get(r["layer"]), r)
            if loss["kept_by_fp32"] and loss["flushed"] > 0:
                out[r["layer"]] = loss["flushed"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:3])


def _raise_by(hist: list[dict], step: int, keep: int) -> tuple[int | None, int | None, dict[int, float],
                                                                dict[int, float]]:
    """From the replay's log2 histogram (FP32 values times the scale in use): the highest bin, the doublings
    of headroom (the largest value stays under 2^HEADROOM_TOP), and, for j = 0 .. headroom doublings, the share of
    the values FP32 keeps that would still flush (bins wholly under 2^-25 after them) and the share that would be
    held with fewer significant bits than BF16 or flushed (bins at or under COARSE_TOP after them)."""
    counts: dict[int, int] = {}
    for r in hist:
        if r["step"] == step:
            counts[r["k"]] = counts.get(r["k"], 0) + r["count"]
    top = max((k for k, n in counts.items() if n), default=None)
    if top is None or not keep:
        return None, None, {}, {}
    room = HEADROOM_TOP - 1 - top
    doublings = range(0, max(room, 0) + 1)
    flush = {j: sum(n for k, n in counts.items() if k <= -26 - j) / keep for j in doublings}
    coarse = {j: sum(n for k, n in counts.items() if k <= COARSE_TOP - j) / keep for j in doublings}
    return top, room, flush, coarse


def fp16_loss_findings(b: _Builder, d: Diagnosis, own: list[dict], replay: list[dict], hist: list[dict]) -> None:
    """What the FP32 replay of the latest replayed census step says FP16 lost at the scale in use (values flushed,
    and precision: values held with fewer significant bits than BF16), and, when it is material while the scale has
    headroom, the scale that would keep it (from the replay's histogram)."""
    step = max(r["step"] for r in replay)
    scale = next(r["at_scale"] for r in replay if r["step"] == step)
    rep, mine = _totals(replay, step), _totals(own, step)
    losses = {src: _lost(mine.get(src), rep[src]) for src in sorted(rep)}
    hist_act = [r for r in hist if r["source"] == ACT]
    top, room, flush, coarse = _raise_by(hist_act, step, losses.get(ACT, {}).get("kept_by_fp32", 0))
    if ACT in losses and coarse:
        losses[ACT]["coarse"] = coarse[0]
    layers = _layer_losses(own, replay, step, ACT)
    d.fp16_loss = {"step": step, "scale": scale, "sources": losses, "layers": layers,
                   "max_scaled_log2": None if top is None else top + 1, "headroom_doublings": room}
    worst = max(losses, key=lambda s: max(losses[s]["flushed"], losses[s].get("coarse", 0.0)))
    w = losses[worst]
    numbers = "; ".join(f"{src.replace('_', ' ')}s {_pct(v['flushed'])} held as zero by FP16 ({_pct(v['direct'])} "
                        f"flush on their own at this scale, {_pct(v['subnormal'])} kept only as subnormals"
                        + (f"; {_pct(v['coarse'])} flushed or held with fewer significant bits than BF16's 8"
                           if "coarse" in v else "") + ")" for src, v in losses.items())
    layer_txt = ("; most in " + ", ".join(f"{k} ({_pct(v)})" for k, v in layers.items())) if layers else ""
    material = (w["flushed"] >= FLUSH_MATERIAL or w["subnormal"] >= SUBNORMAL_MOST
                or w.get("coarse", 0.0) >= COARSE_MATERIAL)
    msg = (f"at scale {fmt_scale(scale)} FP16 lost what FP32 keeps (FP32 replay of census step {step}): "
           f"{numbers}{layer_txt}")
    b.find("fp16_underflow", "warning" if material else "info", msg, scale=scale, census_step=step,
           sources=losses, layers=layers, headroom_doublings=room,
           max_scaled=None if top is None else 2.0 ** (top + 1))
    # below the warning level, a run that flushed >= 1% while its scale has headroom still gets the advice, as an
    # option (the study's runs below FLUSH_MATERIAL lost nothing measurable: docs/census.md)
    if material or (w["flushed"] >= UNDERFLOW_LARGE and room is not None and room >= 1):
        _raise_scale_advice(b, d, scale, worst, w, top, room, flush, coarse, optional=not material)


def _raise_scale_advice(b: _Builder, d: Diagnosis, scale: float, worst: str, w: dict, top: int | None,
                        room: int | None, flush: dict[int, float], coarse: dict[int, float],
                        optional: bool) -> None:
    imprecise = w.get("coarse", 0.0) >= COARSE_MATERIAL and w["flushed"] < FLUSH_MATERIAL
    what = (f"{_pct(w['coarse'])} of the {worst.replace('_', ' ')}s that FP32 keeps (flushed, or kept with fewer "
            "significant bits than BF16's 8)" if imprecise else
            f"{_pct(w['flushed'])} of the {worst.replace('_', ' ')}s that FP32 keeps")
    lost = "lost" if imprecise else "flushed"
    if room is None or room < 1:
        b.recommend("bf16", "Train in bf16 (FP32's range; no loss scale needed): FP16 has no headroom here",
                    f"at scale {fmt_scale(scale)} FP16 {lost} {what}, and the largest scaled gradient is already "
                    f"near 2^{(top or 0) + 1}: a higher scale would overflow", "fp16_underflow",
                    change={"precision": "bf16"})
        return
    # the smallest raise after which under 1% flushes and under 1% is held coarser than BF16
    fit = [j for j in range(1, room + 1) if flush.get(j, 1.0) < FLUSH_TARGET and coarse.get(j, 1.0) < FLUSH_TARGET]
    j = fit[0] if fit else room
    target = scale * 2.0 ** j
    after = (f"under {_pct(FLUSH_TARGET)} would flush or lose bits against BF16" if fit else
             f"{_pct(flush.get(j, 0.0))} would still flush and {_pct(coarse.get(j, 0.0))} hold fewer bits than BF16")
    how = "a loss scale (dynamic scaling, or" if d.policy == "none" else "a higher loss scale (dynamic scaling, or"
    action = f"Use {how} a static scale of {fmt_scale_value(target)})"
    if optional:  # the verdict stays healthy: the advice says it is an option, not a cure
        action = (f"Optional (under the {_pct(FLUSH_MATERIAL)} flushed and {_pct(COARSE_MATERIAL)} coarse that "
                  "the study's runs paid for): " + action[0].lower() + action[1:])
    b.recommend("raise_scale", action,
                f"at scale {fmt_scale(scale)} FP16 {lost} {what}; at {fmt_scale(target)} {after} (FP32 replay "
                f"histogram) and the largest scaled gradient, under {fmt_scale(2.0 ** (top + 1 + j))}, stays under "
                "65504",
                "fp16_underflow", change={"scale": target})

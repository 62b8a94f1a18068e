"""The FP8 rules of the diagnosis: what fp8_census.csv (lab/fp8/census.py: each quantized operand on census steps)
says an FP8 or block-scaled recipe lost, and what would keep it.

Causes, each with advice its evidence supports (docs/diagnose.md, "FP8 runs"; tests/test_diagnose_fp8.py plants each
in a real loop):

* ``fp8_infinite_scale`` (problem): an all-zero row, tile or tensor quantized without a lower bound on its amax got an
  infinite scale and NaN values (pytorch/ao#3356): bound the amax (torchao's EPS, 1e-12).
* ``fp8_delayed_clipping``: delayed scaling's history held an amax below the operand's own, and what jumped beyond it
  was clipped at the format's maximum: current scaling, a margin, or a shorter history.
* ``fp8_flushed``: non-zero values quantized to zero; spread over the layers, the recipe's gradient format or
  granularity (E5M2, a finer granularity); concentrated in one or two layers, those layers kept in BF16.
* ``fp8_block_clipping``: MX blocks whose floor-rounded scale clipped their largest values: RCEIL.
Material from FP8_CLIP_MATERIAL of an operand's elements clipped, FP8_FLUSH_MATERIAL (FP16's FLUSH_MATERIAL) of a
tensor kind's non-zero values flushed, or COARSE_MATERIAL (FP16's) flushed or kept only as FP8 subnormals; below, the
finding is info and its advice is marked optional.
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.diagnose.record import Diagnosis, _Builder, _pct
from lab.diagnose.underflow import COARSE_MATERIAL, FLUSH_MATERIAL

#: an operand with >= 1% of its elements clipped on a census step: the study's recipes clipped <= 0.63% (mxfp8-floor,
#: no resolved cost: results/fp8/tables/recipes.md); clipping takes the largest values, so the bar is low
FP8_CLIP_MATERIAL = 0.01
#: a tensor kind with >= 20% of its non-zero values flushed over the census steps: the study's recipes flushed <= 11.7%
#: of their gradients without a resolved cost, fp8-noscale 97.4% with one (+0.845 nats)
FP8_FLUSH_MATERIAL = FLUSH_MATERIAL
CONCENTRATED = 0.9  # a layer (or two) holding this share of a tensor kind's flushed values: the layer, not the recipe


def fp8_findings(b: _Builder, d: Diagnosis, run_dir: Path) -> None:
    """The FP8 census's findings and advice (module docstring); d.fp8 gets the summary."""
    from lab.fp8.census import read_rows  # the census's one reader (inside: lab.diagnose stays off lab.fp8's
    rows = read_rows(run_dir)             # import chain until an FP8 run is read)
    if not rows:
        return
    d.fp8 = {"census_steps": len({r["step"] for r in rows}), "operands": len({(r["layer"], r["gemm"], r["role"])
                                                                              for r in rows}),
             "formats": sorted({f"{r['element']}/{r['granularity']}/{r['scale_rule']}" for r in rows}),
             "shares": _shares(rows)}
    _infinite_scale(b, rows)
    _delayed_clipping(b, rows)
    _flushed(b, rows)
    _block_clipping(b, rows)


def _shares(rows: list[dict]) -> dict:
    """Per tensor kind over every census row: saturated (of all elements), flushed (of the non-zero), subnormal."""
    out = {}
    from lab.fp8.census import KIND
    for role, kind in KIND.items():
        sel = [r for r in rows if r["role"] == role]
        n, nz = sum(r["numel"] for r in sel), sum(r["nonzero"] for r in sel)
        if n:
            out[kind] = {"saturated": sum(r["saturated"] for r in sel) / n,
                         "flushed": sum(r["flushed"] for r in sel) / nz if nz else 0.0,
                         "subnormal": sum(r["subnormal"] for r in sel) / n}
    return out


def _where(r: dict) -> str:
    return f"{r['layer']} ({r['role'].replace('_', ' ')} of its {r['gemm'].replace('_', ' ')} GEMM)"


def _infinite_scale(b: _Builder, rows: list[dict]) -> None:
    bad = [r for r in rows if r["nonfinite"] and r["zero_blocks"] and math.isfinite(r["amax"])]
    if not bad:
        return
    first = bad[0]  # census order is the order the operands were quantized: the first is where NaN began
    b.find("fp8_infinite_scale", "problem",
           f"at step {first['step']} {_where(first)} held {first['zero_blocks']} all-zero "
           f"{_block_name(first)}(s): an amax of 0 gave an infinite scale and {first['nonfinite']} NaN values "
           f"({len(bad)} operand(s) alike; pytorch/ao#3356)", step=first["step"], layer=first["layer"],
           role=first["role"], zero_blocks=first["zero_blocks"], operands=len(bad))
    b.recommend("amax_floor", "Bound the amax from below before computing a scale (torchao's EPS, 1e-12: "
                "`amax_floor` in the lab's recipes; torchao's float8 does so since pytorch/ao#3356)",
                f"{first['layer']}'s {first['role'].replace('_', ' ')} had all-zero {_block_name(first)}s and "
                "became NaN where its input was finite", "fp8_infinite_scale", change={"amax_floor": 1e-12})


def _block_name(r: dict) -> str:
    return {"tensor": "tensor", "row": "row", "tile": "1x128 tile", "block": "128x128 block", "mx": "MX block",
            "nvfp4": "NVFP4 block", "nvfp4-2d": "NVFP4 16x16 block"}.get(r["granularity"], "block")


def _delayed_clipping(b: _Builder, rows: list[dict]) -> None:
    lagged = [r for r in rows if r["scale_rule"] == "delayed" and r["saturated"] and r["history_amax"] > 0
              and r["amax"] > r["history_amax"]]
    if not lagged:
        return
    worst = max(lagged, key=lambda r: r["saturated"] / r["numel"])
    share, lag = worst["saturated"] / worst["numel"], worst["amax"] / worst["history_amax"]
    material = share >= FP8_CLIP_MATERIAL
    spike = next((f for f in b.findings if f.code == "loss_spike"), None)
    spiked = [s for s in (spike.evidence.get("steps", []) if spike else []) if 0 <= s - worst["step"] <= 1]
    b.find("fp8_delayed_clipping", "warning" if material else "info",
           f"delayed scaling clipped what jumped beyond its history: at step {worst['step']} {_where(worst)} had an "
           f"amax {lag:.3g}x its history's and {_pct(share)} of its values were clipped at the format's maximum "
           f"({len(lagged)} operand(s) on {len({r['step'] for r in lagged})} census step(s))"
           + (f"; the loss spiked at step {spiked[0]}" if spiked else ""),
           step=worst["step"], layer=worst["layer"], lag=lag, clipped=share, operands=len(lagged))
    margin = max(1, math.ceil(math.log2(max(r["amax"] / r["history_amax"] for r in lagged))))
    action = (f"Scale from the current amax (fp8-current), or give delayed scaling a margin of {margin} (2^{margin} "
              "of headroom, the largest jump seen) or a shorter amax history")
    b.recommend("current_scaling", action if material else "Optional: " + action[0].lower() + action[1:],
                f"the history's amax lagged the operand's by up to {lag:.3g}x; {_pct(share)} clipped at step "
                f"{worst['step']}", "fp8_delayed_clipping", change={"recipe": "fp8-current", "margin": margin})


def _flushed(b: _Builder, rows: list[dict]) -> None:
    from lab.fp8.census import KIND
    for role, kind in KIND.items():
        sel = [r for r in rows if r["role"] == role]
        nz = sum(r["nonzero"] for r in sel)
        lost = sum(r["flushed"] for r in sel)
        # precision lost too: FP8 subnormals keep 1-3 significant bits of E4M3's 4 (E2M1's 0.5 is its grid's)
        sub = sum(r["subnormal"] for r in sel if r["element"] != "e2m1")
        if not nz or not (lost or sub):
            continue
        share, coarse = lost / nz, (lost + sub) / nz
        by_layer: dict[str, int] = {}
        for r in sel:
            by_layer[r["layer"]] = by_layer.get(r["layer"], 0) + r["flushed"]
        top = sorted(by_layer.items(), key=lambda kv: -kv[1])[:2]
        concentrated = lost > 0 and len(by_layer) > 2 and sum(v for _, v in top) >= CONCENTRATED * lost
        layers = [k for k, v in top if v >= (1 - CONCENTRATED) * lost] if concentrated else []
        material = share >= FP8_FLUSH_MATERIAL or coarse >= COARSE_MATERIAL
        if not material and max(share, coarse) < 0.01:
            continue
        # delayed scaling with nothing in its history yet (a first step) quantizes at TE's scale 1
        empty = [r for r in sel if r["scale_rule"] == "delayed" and r["history_amax"] == 0]
        first = sum(r["flushed"] for r in empty) / lost if lost else 0.0
        if first >= 0.5:
            layers = []  # not where, but when: the steps whose history was empty
        where = (f"; {_pct(sum(by_layer[k] for k in layers) / lost)} of them in {', '.join(layers)}" if layers
                 else f"; {_pct(first)} of them at step(s) {', '.join(str(s) for s in sorted({r['step'] for r in empty}))}"
                 f", where delayed scaling's history was still empty (TE's initial scale 1)" if first >= 0.5 else "")
        b.find("fp8_flushed", "warning" if material else "info",
               f"{'FP4' if any(r['element'] == 'e2m1' for r in sel) else 'FP8'} flushed {_pct(share)} of the "
               f"non-zero {kind} values to zero over {len({r['step'] for r in sel})} "
               f"census step(s){where}, and kept {_pct(sub / nz)} only as subnormals (fewer significant bits than "
               "the format's normals)", kind=kind, share=share, subnormal=sub / nz, layers=layers, first_step=first)
        if first >= 0.5:
            action = ("Scale a tensor whose delayed history is empty from its own amax (fp8-delayed's initial: "
                      "current), not at TE's scale 1")
            b.recommend("delayed_initial_current", action if material else "Optional: " + action[0].lower() +
                        action[1:], f"{_pct(first)} of the flushed {kind} values flushed at a step whose history was "
                        "empty", "fp8_flushed", change={"initial": "current"})
        else:
            _flush_advice(b, sel, kind, share, layers, material)


def _flush_advice(b: _Builder, sel: list[dict], kind: str, share: float, layers: list[str], material: bool) -> None:
    formats = {(r["element"], r["granularity"]) for r in sel}
    if layers:
        action = f"Keep {', '.join(layers)} in BF16 (a recipe's keep_high; torchao's module_filter_fn)"
        code, change = "keep_high", {"keep_high": layers}
    elif kind == "gradient" and any(e == "e4m3" for e, _ in formats):
        action = ("Quantize the gradients to E5M2 (2^16 more range than E4M3: fp8-current's grad_element e5m2), or "
                  "scale them at a finer granularity (per row or per 1x128 tile)")
        code, change = "e5m2_gradients", {"grad_element": "e5m2"}
    elif any(g == "tensor" for _, g in formats):
        action = f"Scale the {kind}s at a finer granularity (per row or per 1x128 tile: fp8-rowwise, fp8-blockwise)"
        code, change = "finer_granularity", {"granularity": "row"}
    else:
        action = f"Keep the {kind}s in BF16 where they flush (keep_high), or use a format with more range"
        code, change = "keep_high", {"keep_high": sorted({r['layer'] for r in sel})}
    b.recommend(code, action if material else "Optional: " + action[0].lower() + action[1:],
                f"{_pct(share)} of the non-zero {kind} values flushed to zero", "fp8_flushed", change=change)


def _block_clipping(b: _Builder, rows: list[dict]) -> None:
    sel = [r for r in rows if r["granularity"] == "mx" and r["scale_rule"] == "floor" and r["blocks_clipped"]]
    if not sel:
        return
    share = max(r["saturated"] / r["numel"] for r in sel)
    blocks = sum(r["blocks_clipped"] for r in sel) / sum(r["blocks"] for r in sel)
    worst = max(sel, key=lambda r: r["saturated"] / r["numel"])
    material = share >= FP8_CLIP_MATERIAL
    init = _init_at_power_of_two(worst, min(r["step"] for r in rows))
    b.find("fp8_block_clipping", "warning" if material else "info",
           f"MX's floor scale rounding clipped the largest values of {_pct(blocks)} of the blocks (up to "
           f"{_pct(share)} of an operand's values, at step {worst['step']} in {_where(worst)})" + (init or ""),
           blocks=blocks, clipped=share, layer=worst["layer"], role=worst["role"], init_power_of_two=bool(init))
    action = ("Round MX block scales up (RCEIL: Mishra et al. 2025; torchao's ScaleCalculationMode.RCEIL): a block's "
              "largest value then never exceeds the element's maximum")
    b.recommend("rceil", action if material else "Optional: " + action[0].lower() + action[1:],
                f"floor rounding clipped {_pct(blocks)} of the MX blocks", "fp8_block_clipping",
                change={"rounding": "rceil"})


def _init_at_power_of_two(r: dict, first_step: int) -> str | None:
    """Why a weight clips under MX floor rounding at its first census step: PyTorch's default nn.Linear initialisation
    draws uniformly within 1/sqrt(fan_in), exactly a power of two when fan_in is a power of 4, so a block's largest
    weight sits just under 2^k: floor rounding scales it to ~2 x 2^emax, past E4M3's 448 (1.75 x 2^8), and about an
    eighth of the layer clips. None unless the operand is a weight at the first census step whose amax lies within
    1% under a power of two."""
    amax = r["amax"]
    if r["role"] != "weight" or r["step"] != first_step or not amax > 0:
        return None
    top = 2.0 ** math.ceil(math.log2(amax))
    if not 0.99 * top <= amax < top:
        return None
    return (f"; its weights' largest value {amax:.5g} sits just under 2^{int(math.log2(top))}: PyTorch's default "
            "nn.Linear initialisation bounds weights by 1/sqrt(fan_in), a power of two when fan_in is a power of 4 "
            "(64, 256, 1024, 4096), and floor rounding then clips about an eighth of them from the start")

"""The lab's emulated FP8 GEMMs against torch._scaled_mm, and torchao's real FP8 training step against BF16 (a step of benchmarks/gpu/gpu_check.sh).

GEMMs. The forward GEMM of the lab's `fp8-current` (tensorwise: E4M3 x E4M3, one FP32 scale per tensor, torchao's
scale arithmetic) and `fp8-rowwise` (a power-of-two scale per row along k, torchao's rowwise) recipes, as
`lab.fp8.linear.RecipeLinear` computes it (operands quantized by lab/formats, dequantized to FP32, `torch.mm`, the
result rounded once to the output dtype), against `torch._scaled_mm` on the same FP8 codes and scales. The codes are
the lab quantizer's own steps (lab/formats/scaled.py: `amax_of`, `scale_from_amax`, `cast`), checked to dequantize
to exactly the operands the lab's layer multiplies. `_scaled_mm` takes them as torchao passes them: A (M,K)
row-major, B (K,N) column-major (the weight's codes, transposed), scale_a / scale_b the INVERSE scales (FP32; 0-d per
tensor, (M,1) and (1,N) per row), use_fast_accum off and on, out_dtype BF16 and FP32 (a combination `_scaled_mm`
refuses is recorded as unsupported, with its message).

Shapes: gpt-tiny's linears (M = 1024 tokens, K in {64, 256}, N in {64, 192, 256}) and a K sweep to 8192 at M = N = 256
with normal and all-positive operands (all-positive sums show a narrow accumulator's loss most plainly). Every draw is
BF16-representable (CPU generator, fixed seed), so the BF16 and FP32 outputs share their operands.

Each output is compared with the FP64 product of the operands it multiplies, rounded to the output dtype: the lab's
with `q / s` (FP32, the lab's and torchao's dequantization), `_scaled_mm`'s with `(q_a @ q_b) * (1/s_a) * (1/s_b)`
(scales applied to the exact sum, as the hardware's epilogue does). For power-of-two scales (rowwise) the two
references are the same number; for tensorwise they differ by FP32's rounding of the operands, recorded as
`reference_gap` (max |difference| / max |reference|). Per comparison: the share of outputs that differ, the largest
difference in ulps of the output dtype (benchmarks/gpu/contract_vs_cuda.py's counter), the largest elementwise relative
error and the largest error over the largest reference (`norm_rel`). Also: the lab against `_scaled_mm` directly, and
the lab's model of Hopper's accumulator (lab/formats/accumulate.py: `promote` beside use_fast_accum off, `fast` beside
on) against the reference and against `_scaled_mm`.

Step time (CUDA; on a CPU the same code at tiny size, a rehearsal, not a measurement): torchao's
`convert_to_float8_training` (recipes tensorwise and rowwise; the tied head kept in BF16, as the lab's recipes keep
it) on the lab's GPT (lab/models/gpt.py; 4 layers, width 1024, 8 heads, context 256, batch 16, vocabulary 256) against
the same model's BF16 autocast step: one model per variant (same initial weights), AdamW, blocks of steps, the order
rotating every round; the ratio is the median over rounds of the variant's block time over BF16's. Eager unless
--compile (torchao's FP8 is meant to be compiled: eager casts are separate kernels). Without torchao the section
records why it was skipped.

    python benchmarks/gpu/fp8_vs_scaled_mm.py --device cuda --out DIR     # DIR/fp8_vs_scaled_mm.{json,md}
    python benchmarks/gpu/fp8_vs_scaled_mm.py --device cpu --tiny --out DIR   # the rehearsal (seconds)

The JSON is rewritten after every shape, so a run stopped at its limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.core import files  # noqa: E402
from lab.formats import scaled  # noqa: E402
from lab.formats.elements import fp8_to_float  # noqa: E402
from lab.fp8 import create_recipe  # noqa: E402
from lab.fp8.linear import RecipeLinear  # noqa: E402
from lab.run.process import set_true_fp32  # noqa: E402

GRANULARITIES = {"tensorwise": "fp8-current", "rowwise": "fp8-rowwise"}  # torchao's recipe name -> the lab's
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODEL_FOR_FAST_ACCUM = {False: "promote", True: "fast"}  # the lab's accumulator model beside each _scaled_mm setting
STATS = ("differ_share", "max_ulps", "max_rel", "norm_rel")
SETS = ("gpt-tiny", "k-sweep")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


contract = _load("contract_vs_cuda")  # its ulp counter (ordered floats) and per-comparison statistics


# --- GEMMs -----------------------------------------------------------------------------------------------
def shapes(tiny: bool, sets=SETS) -> list[dict]:
    """gpt-tiny's linears and the K sweep (module docstring); --tiny: the same sets at rehearsal size."""
    m = 32 if tiny else 1024
    gpt = [{"set": "gpt-tiny", "m": m, "k": k, "n": n, "dist": "normal"} for k in (64, 256) for n in (64, 192, 256)]
    ks, mn = ((256, 1024), 32) if tiny else ((256, 512, 1024, 2048, 4096, 8192), 256)
    sweep = [{"set": "k-sweep", "m": mn, "k": k, "n": mn, "dist": dist} for dist in ("normal", "positive") for k in ks]
    return [s for s in gpt + sweep if s["set"] in sets]


def draw(shape: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x (M,K) and a weight w (N,K), FP32 holding BF16 values; a CPU generator (every device the same)."""
    g = torch.Generator().manual_seed(seed)
    m, k, n = shape["m"], shape["k"], shape["n"]
    if shape["dist"] == "positive":
        x, w = torch.rand(m, k, generator=g), torch.rand(n, k, generator=g)
    else:
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
    return x.bfloat16().float(), w.bfloat16().float()


def codes(t: torch.Tensor, fmt, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t's FP8 codes and FP32 scale(s) by the lab quantizer's own steps (lab/formats/scaled.py's quantize_scaled
    before its dequantization): the amax, torchao's scale, the saturating cast."""
    scale = scaled.scale_from_amax(scaled.amax_of(t, fmt.granularity, k_dim), fmt.element, fmt.scale)
    return scaled.cast(t.to(torch.float32) * scale, fmt.element, fmt.saturate), scale


def layer(w: torch.Tensor, recipe) -> RecipeLinear:
    """The lab's linear layer (weight w, no bias) under the recipe."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(w)
    return RecipeLinear.from_linear(lin, recipe, "fc")


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """`out` against `ref` rounded once to out's dtype: contract_vs_cuda's share differing, max ulps and max
    (elementwise) relative error, and the largest error over the largest reference."""
    s = contract.stats(out.cpu(), ref.cpu())
    err = (out.cpu().double() - ref.cpu().to(out.dtype).double()).abs().max()
    s["norm_rel"] = float(err / ref.cpu().double().abs().max().clamp(min=torch.finfo(torch.float64).tiny))
    return s


def measure_shape(shape: dict, device: str) -> list[dict]:
    """Every (granularity, use_fast_accum, out dtype) at one shape: one record each."""
    x, w = (t.to(device) for t in draw(shape))
    rows = []
    for gran, recipe_name in GRANULARITIES.items():
        recipe = create_recipe(recipe_name)
        f = recipe.forward
        lab = layer(w, recipe)
        # _scaled_mm's operands: A's codes row-major, B = the weight's codes transposed (K,N), column-major
        qa, sa = codes(x, f.a, 1)
        qb, sb = codes(w.t(), f.b, 0)
        qb = qb.t().contiguous().t()
        inv_a, inv_b = sa.reciprocal().contiguous(), sb.reciprocal().contiguous()
        with torch.no_grad():
            a_lab, b_lab = lab.operand(x, f.a, "input", 1), lab.operand(w.t(), f.b, "weight", 0)
        same = torch.equal(fp8_to_float(qa) / sa, a_lab) and torch.equal(fp8_to_float(qb) / sb, b_lab)
        if not same:  # the comparison would be of different operands: refuse it
            raise AssertionError(f"{gran} {shape}: the codes do not dequantize to the lab layer's operands")
        ref_lab = a_lab.double() @ b_lab.double()
        ref_hw = (qa.double() @ qb.double()) * inv_a.double() * inv_b.double()
        gap = float((ref_lab - ref_hw).abs().max() / ref_lab.abs().max())
        with torch.no_grad():
            outs_lab = {name: lab(x.to(dtype)) for name, dtype in OUT_DTYPES.items()}
        for fast in (False, True):
            # the accumulator model (slow: FP64 where the products are not exact in FP32) once, in FP32: its BF16
            # output is that rounded once, as the layer rounds it for a BF16 input (the same operands: BF16 draws)
            with torch.no_grad():
                model32 = layer(w, recipe.with_accumulate(MODEL_FOR_FAST_ACCUM[fast]))(x)
            for name, dtype in OUT_DTYPES.items():
                row = dict(shape, granularity=gran, recipe=recipe_name, use_fast_accum=fast, out_dtype=name,
                           scale_shapes=[list(sa.shape), list(sb.shape)], reference_gap=gap)
                try:
                    out = torch._scaled_mm(qa, qb, scale_a=inv_a, scale_b=inv_b, out_dtype=dtype, use_fast_accum=fast)
                    if device == "cuda":
                        torch.cuda.synchronize()
                except (RuntimeError, NotImplementedError, ValueError) as e:  # refused by this torch on this device
                    row.update(status="unsupported", error=str(e).splitlines()[0][:300])
                    rows.append(row)
                    continue
                out_model = model32.to(dtype)
                row.update(status="ok", scaled_mm=compare(out, ref_hw), lab=compare(outs_lab[name], ref_lab),
                           lab_vs_scaled_mm=compare(outs_lab[name], out.double()),
                           lab_model={"accumulate": MODEL_FOR_FAST_ACCUM[fast], **compare(out_model, ref_lab)},
                           lab_model_vs_scaled_mm=compare(out_model, out.double()))
                rows.append(row)
    return rows


# --- torchao's FP8 training step against BF16 ----------------------------------------------------------
def step_time(device: str, tiny: bool, rounds: int, steps: int, warmup: int, compile_: bool) -> dict:
    """torchao's float8 training (tensorwise, rowwise) on the lab's GPT against its BF16 autocast step, blocks of
    steps alternating (module docstring). Skipped, with the reason, where torchao cannot be imported."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 (absent, or built for another torch: either way nothing to measure)
        return {"status": "skipped", "reason": f"torchao not importable: {type(e).__name__}: {e}"}
    from lab.models.gpt import GPTConfig
    if tiny:
        cfg, batch = GPTConfig(vocab_size=256, context=32, n_layer=2, n_head=4, d_model=64), 4
    else:
        cfg, batch = GPTConfig(vocab_size=256, context=256, n_layer=4, n_head=8, d_model=1024), 16
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.context), generator=g).to(device)

    def build(recipe: str | None):
        torch.manual_seed(0)
        model = cfg.build().to(device).train()
        if recipe is not None:  # every nn.Linear but the tied head (the lab's recipes keep it in BF16 too)
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda mod, fqn: fqn != "head")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.05)  # the weights hardly move
        return model, (torch.compile(model) if compile_ else model), opt

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def block(variant, n: int) -> float:
        model, forward, opt = variant
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, torch.bfloat16):
                logits = forward(x)
            F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1)).backward()
            opt.step()
        sync()
        return time.perf_counter() - t0

    variants, errors = {}, {}
    for name, recipe in (("bf16", None), ("tensorwise", "tensorwise"), ("rowwise", "rowwise")):
        try:
            variants[name] = build(recipe)
            block(variants[name], warmup)
        except Exception as e:  # noqa: BLE001 (a recipe this device or torch cannot run: recorded, the rest go on)
            variants.pop(name, None)
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if device == "cuda":
                torch.cuda.empty_cache()
    out = {"status": "ok" if "bf16" in variants and len(variants) > 1 else "failed", "torchao": torchao.__version__,
           "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head, "context": cfg.context,
                     "vocab_size": cfg.vocab_size, "batch": batch},
           "compiled": compile_, "rounds": rounds, "steps_per_block": steps, "warmup_steps": warmup,
           "autocast": "torch.autocast bf16", "errors": errors, "variants": {}}
    if out["status"] != "ok":
        return out
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates every round
            times[name].append(block(variants[name], steps))
    for name in names:
        per = [t / b for t, b in zip(times[name], times["bf16"])]
        out["variants"][name] = {"ms_per_step": statistics.median(times[name]) / steps * 1e3,
                                 "blocks_s": times[name], "over_bf16": statistics.median(per),
                                 "over_bf16_range": [min(per), max(per)],
                                 "tokens_per_s": batch * cfg.context * steps / statistics.median(times[name])}
    if device == "cuda":
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


# --- report ----------------------------------------------------------------------------------------------
def _cell(s: dict) -> str:
    return f"{s['differ_share']:.1%} / {s['max_ulps']} / {s['norm_rel']:.1e}"


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"# The lab's emulated FP8 GEMMs against torch._scaled_mm ({env['device_name']}, torch {env['torch']})", "",
             "Each cell: share of outputs differing / max ulps of the output dtype / max error over max reference. "
             "`_scaled_mm` and the lab against the FP64 product of their own dequantized operands (q/s for the lab, "
             "q*(1/s) for `_scaled_mm`; the same for rowwise's power-of-two scales); the lab's accumulator model is "
             "`promote` beside use_fast_accum off, `fast` beside on.", "",
             "| set | M | K | N | dist | scales | fast accum | out | _scaled_mm vs FP64 | lab vs FP64 | "
             "lab vs _scaled_mm | lab model vs FP64 | lab model vs _scaled_mm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["gemms"]:
        head = (f"| {r['set']} | {r['m']} | {r['k']} | {r['n']} | {r['dist']} | {r['granularity']} | "
                f"{'on' if r['use_fast_accum'] else 'off'} | {r['out_dtype']} |")
        if r["status"] != "ok":
            lines.append(f"{head} unsupported: {r['error'][:80]} | | | | |")
            continue
        lines.append(f"{head} {_cell(r['scaled_mm'])} | {_cell(r['lab'])} | {_cell(r['lab_vs_scaled_mm'])} | "
                     f"{_cell(r['lab_model'])} | {_cell(r['lab_model_vs_scaled_mm'])} |")
    st = report["step_time"]
    lines += ["", "## torchao's FP8 training step against BF16 autocast", ""]
    if st["status"] == "skipped":
        lines.append(f"Skipped: {st['reason']}")
    else:
        m = st["model"]
        lines += [f"The lab's GPT ({m['n_layer']} layers, width {m['d_model']}, context {m['context']}, batch "
                  f"{m['batch']}), torchao {st['torchao']}, {'compiled' if st['compiled'] else 'eager'}, "
                  f"{st['rounds']} rounds of {st['steps_per_block']} steps, order rotating"
                  + (" (a CPU rehearsal: not a measurement)." if env["device"] == "cpu" else "."), "",
                  "| variant | ms per step | tokens/s | x BF16 (median) [range] |", "|---|---|---|---|"]
        for name, v in st["variants"].items():
            lo, hi = v["over_bf16_range"]
            lines.append(f"| {name} | {v['ms_per_step']:.2f} | {v['tokens_per_s']:.0f} | {v['over_bf16']:.3f} "
                         f"[{lo:.3f}-{hi:.3f}] |")
        lines += [f"| {name} | failed: {err} | | |" for name, err in st["errors"].items()]
    return "\n".join(lines) + "\n"


def summary_lines(report: dict) -> list[str]:
    """Worst case per (scales, fast accum, out dtype) over the shapes: what the log shows."""
    lines = []
    for gran in GRANULARITIES:
        for fast in (False, True):
            for name in OUT_DTYPES:
                got = [r for r in report["gemms"]
                       if (r["granularity"], r["use_fast_accum"], r["out_dtype"]) == (gran, fast, name)]
                ok = [r for r in got if r["status"] == "ok"]
                if not ok:
                    lines.append(f"{gran:10s} fast={fast!s:5s} {name}: unsupported ({got[0]['error'][:60] if got else ''})")
                    continue
                worst = {key: (max(r[key]["max_ulps"] for r in ok), max(r[key]["norm_rel"] for r in ok))
                         for key in ("scaled_mm", "lab", "lab_vs_scaled_mm", "lab_model_vs_scaled_mm")}
                lines.append(f"{gran:10s} fast={fast!s:5s} {name}: max ulps (max err/max ref) " + ", ".join(
                    f"{key} {u} ({rel:.1e})" for key, (u, rel) in worst.items()))
    st = report["step_time"]
    if st["status"] == "skipped":
        lines.append(f"step time: skipped ({st['reason']})")
    else:
        lines.append("step time x BF16: " + ", ".join(f"{n} {v['over_bf16']:.3f}" for n, v in st["variants"].items())
                     + "".join(f"; {n} failed: {e}" for n, e in st["errors"].items()))
    return lines


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="folder: fp8_vs_scaled_mm.json and fp8_vs_scaled_mm.md")
    p.add_argument("--tiny", action="store_true", help="rehearsal sizes (a CPU: seconds)")
    p.add_argument("--sets", default=",".join(SETS), help=f"shape sets, comma-separated: {', '.join(SETS)}")
    p.add_argument("--no-step-time", action="store_true", help="the GEMMs only")
    p.add_argument("--compile", action="store_true", help="torch.compile every variant of the step-time section")
    p.add_argument("--rounds", type=int, default=None, help="step time: rounds (default 6; --tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="step time: steps per block (default 5; --tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="step time: warm-up steps per variant (default 5; --tiny 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device).type
    set_true_fp32(device)  # the lab's FP32 GEMM is FP32, not TF32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "lab emulated FP8 GEMM vs torch._scaled_mm; torchao FP8 step vs BF16",
              "env": {"device": device, "device_name": files.device_name(device), "torch": torch.__version__,
                      "cuda": torch.version.cuda, "git": files.git_commit(), "time": files.now_iso(), "tiny": args.tiny,
                      "torchao_force_skip_loading_so_files": os.environ.get("TORCHAO_FORCE_SKIP_LOADING_SO_FILES")},
              "gemms": [], "step_time": {"status": "skipped", "reason": "not run yet"}}

    def write():
        files.atomic_write_json(out_dir / "fp8_vs_scaled_mm.json", report)
        files.atomic_write_text(out_dir / "fp8_vs_scaled_mm.md", markdown(report))

    t0 = time.perf_counter()
    for shape in shapes(args.tiny, args.sets.split(",")):
        report["gemms"] += measure_shape(shape, args.device)
        write()
    report["gemm_seconds"] = time.perf_counter() - t0
    if args.no_step_time:
        report["step_time"] = {"status": "skipped", "reason": "--no-step-time"}
    else:
        t1 = time.perf_counter()
        report["step_time"] = step_time(args.device, args.tiny, args.rounds or (2 if args.tiny else 6),
                                        args.steps or (1 if args.tiny else 5), args.warmup or (1 if args.tiny else 5),
                                        args.compile)
        report["step_time_seconds"] = time.perf_counter() - t1
    write()
    print("\n".join(summary_lines(report)))
    print(f"fp8_vs_scaled_mm: {len(report['gemms'])} GEMM records, {time.perf_counter() - t0:.1f} s")
    return 0 if report["step_time"]["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())

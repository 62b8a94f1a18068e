"""benchmarks/gpu/fp8_vs_scaled_mm.py (a step of gpu_check.sh) rehearsed on the CPU: the rehearsal writes
its files; on the CPU torch._scaled_mm and the lab's emulated GEMM are each within FP32 accumulation's bound of the
exact product of their operands (which kernel the CPU's _scaled_mm runs, and in what order it sums, depend on the
build, the CPU and its ATen capability: its bits matched the lab's on some CPUs and not on a Sapphire Rapids), so
within the sum of both bounds of each other; the ulp counter counts the floats between on constructed cases."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark

from lab.fp8 import create_recipe

bench = load_benchmark("gpu/fp8_vs_scaled_mm")
U = torch.finfo(torch.float32).eps / 2  # FP32's unit roundoff, 2^-24


def test_the_cpu_rehearsal_writes_its_files(tmp_path, capsys):
    out = tmp_path / "sub"
    assert bench.main(["--device", "cpu", "--tiny", "--sets", "gpt-tiny", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fp8_vs_scaled_mm.json", "fp8_vs_scaled_mm.md"]  # no temporary
    report = json.loads((out / "fp8_vs_scaled_mm.json").read_text())
    assert report["env"]["device"] == "cpu" and report["env"]["torch"] == torch.__version__
    rows = report["gemms"]
    # 6 gpt-tiny shapes x (tensorwise, rowwise) x use_fast_accum off/on x (bf16, fp32): _scaled_mm takes all on a CPU
    assert len(rows) == 48 and {r["status"] for r in rows} == {"ok"}
    assert {(r["k"], r["n"]) for r in rows} == {(k, n) for k in (64, 256) for n in (64, 192, 256)}
    for r in rows:
        for key in ("scaled_mm", "lab", "lab_vs_scaled_mm", "lab_model", "lab_model_vs_scaled_mm"):
            assert set(bench.STATS) <= set(r[key]) and 0 <= r[key]["differ_share"] <= 1, (key, r)
        assert r["lab_model"]["accumulate"] == ("fast" if r["use_fast_accum"] else "promote")
        if r["granularity"] == "rowwise":  # power-of-two scales: the two FP64 references are one exact number
            assert r["reference_gap"] == 0
            assert r["scale_shapes"] == [[r["m"], 1], [1, r["n"]]]
        else:
            assert r["scale_shapes"] == [[], []]
    st = report["step_time"]
    assert st["status"] == "ok" and list(st["variants"]) == ["bf16", "tensorwise", "rowwise"] and not st["errors"]
    assert st["variants"]["bf16"]["over_bf16"] == 1 and all(v["ms_per_step"] > 0 for v in st["variants"].values())
    md = (out / "fp8_vs_scaled_mm.md").read_text()
    assert sum(line.startswith("| gpt-tiny |") for line in md.splitlines()) == 48
    assert "| tensorwise |" in md and "rehearsal" in md
    assert "step time x BF16: bf16 1.000" in capsys.readouterr().out


@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(48, 64, 32, "normal"), (32, 1024, 48, "positive")])
def test_scaled_mm_on_the_cpu_equals_the_lab_within_fp32_accumulation(gran, shape):
    m, k, n, dist = shape
    x, w = bench.draw({"m": m, "k": k, "n": n, "dist": dist}, seed=3)
    recipe = create_recipe(bench.GRANULARITIES[gran])
    f = recipe.forward
    qa, sa = bench.codes(x, f.a, 1)
    qb, sb = bench.codes(w.t(), f.b, 0)
    qb = qb.t().contiguous().t()
    assert qb.shape == (k, n) and qb.stride() == (1, k)  # column-major, as CUDA's _scaled_mm requires
    layer = bench.layer(w, recipe)
    with torch.no_grad():
        lab = layer(x)
        a, b = layer.operand(x, f.a, "input", 1), layer.operand(w.t(), f.b, "weight", 0)
    gamma = k * U / (1 - k * U)
    # _scaled_mm's operands in exact arithmetic, q * (1/s) with the FP32 inverse scales it is given: the FP64 sum of
    # the codes' products is exact (8-bit products, K <= 1024), the scales applied after it within 2^-52
    inv_a, inv_b = sa.reciprocal().double(), sb.reciprocal().double()
    exact = (qa.double() @ qb.double()) * inv_a * inv_b
    size = (qa.double().abs() @ qb.double().abs()) * inv_a.abs() * inv_b.abs()  # sum |products|
    for fast in (False, True):
        got = torch._scaled_mm(qa, qb, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32,
                               use_fast_accum=fast)
        # any FP32 evaluation: the operands dequantized in FP32 (2u per product) or the scales applied to the FP32
        # sum (2 roundings of the output, <= u each, and one of the scales' product), then FP32 accumulation
        assert ((got.double() - exact).abs() <= (gamma + 4 * U) * size).all()
        # the lab's operands q / s differ from q * (1/s) by FP32 roundings (none for power-of-two scales): each
        # product by <= 6u relatively; both sums within gamma_K of the exact one
        bound = (2 * gamma + 6 * U + 2 * U) * (a.double().abs() @ b.double().abs())
        assert ((got.double() - lab.double()).abs() <= bound).all()
        if gran == "rowwise":  # power-of-two scales: the same operands, two FP32 sums of the same exact products
            assert torch.equal(qa.double() * inv_a, a.double()) and torch.equal(qb.double() * inv_b, b.double())
            assert ((got.double() - lab.double()).abs() <= 2 * gamma * (a.double().abs() @ b.double().abs())).all()
    if gran == "tensorwise":  # the bound is not vacuous: the scales are not powers of two here
        assert not torch.equal(torch.frexp(sa)[0], torch.full_like(sa, 0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_ulp_counter_on_constructed_cases(dtype):
    def up(t, n):  # n floats of t's dtype up (negative: down)
        for _ in range(abs(n)):
            t = torch.nextafter(t, torch.full_like(t, float("inf") if n > 0 else float("-inf")))
        return t
    eps = torch.finfo(dtype).eps
    sub = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))  # the smallest subnormal
    one = torch.ones((), dtype=dtype)
    ref = torch.stack([one, 0.75 * one, -3 * one, sub, 0 * one, one])
    # 3 up; equal; 2 down from -3 (ulp 2 eps there); across zero (+sub to -sub: 2); equal; equal
    out = torch.stack([up(one, 3), ref[1], up(ref[2], -2), -sub, ref[4], ref[5]])
    s = bench.compare(out, ref.double())
    assert s["max_ulps"] == 3 and s["differ_share"] == pytest.approx(3 / 6)
    assert s["norm_rel"] == pytest.approx(4 * eps / 3)  # the largest error (2 ulps of 2 eps) over max |ref| = 3
    assert bench.compare(up(one, -1)[None], one[None].double())["max_ulps"] == 1  # across a binade: 1 - eps/2 and 1
    # the reference is rounded once to the output's dtype: a value between two floats is 0 ulps from its rounding
    half = torch.tensor([1.0 + torch.finfo(dtype).eps / 4], dtype=torch.float64)
    assert bench.compare(torch.ones(1, dtype=dtype), half)["max_ulps"] == 0
    assert bench.compare(torch.ones(1, dtype=dtype), half)["norm_rel"] == 0

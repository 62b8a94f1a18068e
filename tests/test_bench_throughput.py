"""benchmarks/speed/bench_throughput.py on CPU with --tiny: the report's structure and sanity, the target logic, and
that the benchmark runs where jsonschema is missing (the GPU machine)."""

import csv
import json
import math
import sys

import torch

from conftest import REPO, load_benchmark

FAMILIES = ("resnet50", "mobilenetv2", "vit", "lm")


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def spy_autocast(monkeypatch) -> list:
    """Every precision the benchmark's forward passes ran under through the lab's CPU path
    (lab.numerics.precision.autocast_for: the tensor-core contract for FP16), recorded as it is entered."""
    import lab.numerics.precision as precision
    seen, real = [], precision.autocast_for

    def spy(precision, device, *a, **k):
        seen.append(precision)
        return real(precision, device, *a, **k)
    monkeypatch.setattr(precision, "autocast_for", spy)
    return seen


def spy_census(monkeypatch) -> list:
    """Per monitor the benchmark makes, how many census steps counted the gradients (after_backward on a census
    step records its rows)."""
    from lab.numerics.monitor import NumericsMonitor
    counts, real = [], NumericsMonitor.after_backward

    def spy(self):
        if not counts or getattr(self, "_spied", None) is None:
            self._spied = len(counts)
            counts.append(0)
        counts[self._spied] += bool(self._census_now)
        return real(self)
    monkeypatch.setattr(NumericsMonitor, "after_backward", spy)
    return counts


def test_tiny_cpu_run_writes_json_and_csv(tmp_path, monkeypatch):
    bench = load_benchmark("speed/bench_throughput")
    seen = spy_autocast(monkeypatch)
    counted = spy_census(monkeypatch)
    before = (torch.get_num_threads(), torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    out = tmp_path / "nested" / "throughput.json"
    report = bench.main(["--device", "cpu", "--tiny", "--threads", "1", "--strict", "--out", str(out)])
    # the timed steps went through the lab's path for every precision it ran (not plain torch.autocast)
    assert {"fp32", "fp16", "bf16"} <= set(seen)
    # the global torch settings it changed are put back
    assert (torch.get_num_threads(), torch.get_float32_matmul_precision(),
            torch.backends.cuda.matmul.allow_tf32) == before

    data = json.loads(out.read_text())
    assert data["summary"] == json.loads(json.dumps(report["summary"]))
    assert data["config"]["device"] == "cpu" and data["config"]["tiny"] is True
    assert data["config"]["autocast"] == "lab.numerics.precision.autocast_for"  # the lab's CPU path, not plain autocast
    assert data["hardware"]["cpu_model"] and data["software"]["torch"] == torch.__version__
    rows = data["rows"]
    by = {}
    for r in rows:
        by.setdefault((r["family"], r["precision"]), []).append(r)
    assert set(by) == {(f, p) for f in FAMILIES for p in ("fp32", "tf32", "fp16", "bf16")}
    for fam in FAMILIES:
        assert [r["status"] for r in by[(fam, "tf32")]] == ["skipped"]  # a CUDA mode
        for p in ("fp32", "fp16", "bf16"):
            for r in by[(fam, p)]:
                assert r["status"] == "ok", r
                assert finite_positive(r["samples_per_s"]) and finite_positive(r["ms_per_step"])
                assert finite_positive(r["peak_memory_mb"])
                assert math.isclose(r["samples_per_s"] * r["ms_per_step"] / 1e3, r["batch"], rel_tol=1e-9)
                assert len(r["blocks_s"]) == data["config"]["rounds"] == 2
                if fam == "lm":
                    assert math.isclose(r["tokens_per_s"], r["samples_per_s"] * r["input"])
                else:
                    assert r["tokens_per_s"] is None
        # fp16: both scalers, measured in the same rounds, one shared ratio
        fp16 = by[(fam, "fp16")]
        assert sorted(r["scaler"] for r in fp16) == ["lab.scaling dynamic", "torch.amp.GradScaler"]
        ratio = fp16[0]["scaler_time_ratio"]
        assert finite_positive(ratio) and fp16[1]["scaler_time_ratio"] == ratio
        s = data["summary"]["families"][fam]
        assert s["scaler_time_ratio_lab_over_torch"] == ratio and len(s["scaler_round_ratios"]) == 2
        assert math.isclose(ratio, sorted(s["scaler_round_ratios"])[0] / 2 + sorted(s["scaler_round_ratios"])[1] / 2)
        # a census step's cost: on the lab scaler's row only, and the census really ran (a warm-up census step,
        # then one block of steps // 2 (at least 1) per round, each counting the gradients once)
        lab_row = next(r for r in fp16 if r["scaler"] == "lab.scaling dynamic")
        assert finite_positive(lab_row["census_step_ratio"])
        assert s["census_step_over_step"] == lab_row["census_step_ratio"]
        assert next(r for r in fp16 if r is not lab_row)["census_step_ratio"] is None
        for key in ("fp16_over_fp32", "bf16_over_fp32", "bf16_over_fp16"):
            assert finite_positive(s[key])
        assert s["tf32_over_fp32"] is None and s["fp16_over_tf32"] is None
    assert counted == [1 + 2 * 1] * len(FAMILIES)  # --tiny: 1 step per block, 2 rounds
    torch_fp16 = next(r for r in by[("resnet50", "fp16")] if r["scaler"] == "torch.amp.GradScaler")
    assert math.isclose(data["summary"]["families"]["resnet50"]["fp16_over_fp32"],
                        torch_fp16["samples_per_s"] / by[("resnet50", "fp32")][0]["samples_per_s"])
    assert data["summary"]["targets"]["evaluated"] is False  # datacenter-GPU targets: not judged on a CPU

    with open(out.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == bench.CSV_FIELDS and len(table) == len(rows)
    assert {(r["family"], r["precision"], r["scaler"]) for r in table} == {
        (r["family"], r["precision"], r["scaler"]) for r in rows}
    assert sorted(p.name for p in out.parent.iterdir()) == ["throughput.csv", "throughput.json"]


def test_targets_are_judged_on_cuda_rows():
    bench = load_benchmark("speed/bench_throughput")

    def row(precision, rate, scaler="none", ratio=None):
        return {"family": "resnet50", "precision": precision, "status": "ok", "samples_per_s": rate,
                "scaler": scaler, "scaler_time_ratio": ratio, "_round_ratios": [ratio]}
    rows = [row("fp32", 1000.0), row("tf32", 2000.0), row("bf16", 2900.0),
            row("fp16", 2800.0, bench.SCALER_NAMES["torch"], 1.004),
            row("fp16", 2789.0, bench.SCALER_NAMES["lab"], 1.004)]
    s = bench.summarise(rows, torch.device("cuda"))
    fam = s["families"]["resnet50"]
    assert fam["fp16_over_fp32"] == 2.8 and fam["fp16_over_tf32"] == 1.4 and fam["tf32_over_fp32"] == 2.0
    t = s["targets"]
    assert t["evaluated"] and t["resnet50_fp16_over_fp32"]["met"] is True and t["scaler_time_ratio"]["met"] is True
    assert t["resnet50_fp16_over_tf32_vs_nvidia"] == {"nvidia_a100_amp_over_tf32": 2.63, "value": 1.4}
    rows[0]["samples_per_s"] = 1200.0  # 2800 / 1200 = 2.33 < 2.6
    rows[3]["scaler_time_ratio"] = rows[4]["scaler_time_ratio"] = 1.02
    t = bench.summarise(rows, torch.device("cuda"))["targets"]
    assert t["resnet50_fp16_over_fp32"]["met"] is False and t["scaler_time_ratio"]["met"] is False
    assert bench.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert bench.gpu_slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"


def test_runs_without_jsonschema(tmp_path, monkeypatch):
    """The GPU machine has PyTorch and timm but not jsonschema: the benchmark must not need lab.core.config."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    for name in [m for m in sys.modules if m in ("lab.core.config", "lab.run.train") or m.startswith("jsonschema.")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    bench = load_benchmark("speed/bench_throughput")
    seen = spy_autocast(monkeypatch)
    _, source = bench._autocast_for()
    bench.main(["--device", "cpu", "--tiny", "--threads", "1", "--strict", "--models", "lm", "--precisions",
                "fp32,fp16", "--out", str(tmp_path / "t.json")])
    assert {"fp32", "fp16"} <= set(seen)
    assert "lab.core.config" not in sys.modules and "lab.run.train" not in sys.modules
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["config"]["autocast"] == source and [r["status"] for r in data["rows"]] == ["ok", "ok", "ok"]

"""Smoke test of benchmarks/bench_scaler.py: a tiny run writes a complete JSON report."""

import importlib.util
import json
from pathlib import Path

import torch

torch.set_num_threads(1)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scaler.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_scaler", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_scaler_tiny_run_writes_report(tmp_path):
    bench = load_bench()
    out = tmp_path / "nested" / "scaler.json"
    report = bench.main(["--out", str(out), "--reps", "2", "--block", "2", "--warmup", "1",
                         "--batch", "4", "--image", "8", "--device", "cpu"])
    assert torch.get_num_threads() == 1
    data = json.loads(out.read_text())
    assert data["ratio_lab_over_pytorch"] == report["ratio_lab_over_pytorch"] > 0
    for key in ("train_step", "scaler_only"):
        res = data["results"][key]
        assert len(res["per_block_s_per_step"]["lab"]) == 2 == len(res["per_block_s_per_step"]["pytorch"])
        assert res["median_s_per_step"]["lab"] > 0 and res["median_s_per_step"]["pytorch"] > 0
    assert data["hardware"]["cpu_model"] and data["hardware"]["torch_threads"] == 1
    assert data["software"]["torch"] == torch.__version__
    assert data["meets_target"] == (data["ratio_lab_over_pytorch"] <= 1.05)
    assert [p.name for p in out.parent.iterdir()] == ["scaler.json"]  # temp file replaced, none left

"""benchmarks/gpu/gpu_check.sh --rehearse: the prepared CUDA check run end to end on the CPU at tiny size, so that
the script a GPU session runs once has run before. Every step must finish and pack what it measured into
$OUT/gpu_check.tar, the one file (beside log.txt) that comes back from the GPU machine."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO

from lab.data.text import corpus_provenance


@pytest.mark.study  # the benchmark's rehearsal (~70 s): `make test-studies`, which CI runs after the suite
def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               GPU_CHECK_COMMIT="0123abc")
    res = subprocess.run(["bash", "benchmarks/gpu/gpu_check.sh", "--rehearse"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=500)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert res.returncode == 0, log[-3000:] + res.stderr[-3000:]
    assert "SKIPPED" not in log and "Traceback" not in log, log[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.tar", "log.txt"]
    with tarfile.open(tmp_path / "out" / "gpu_check.tar") as tar:
        packed = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}

        def read(name: str) -> str:
            return tar.extractfile(packed[name]).read().decode()
        assert "failed.txt" not in packed, read("failed.txt")
        envtxt = read("env.txt")
        assert "commit 0123abc" in envtxt and "failed steps: 0" in envtxt
        # the corpus the LM runs read is named by its hash (the GPU machine's Python has other pydoc text)
        assert json.dumps(corpus_provenance("pydoc", None)) in envtxt
        assert " passed" in read("tests.txt") and "failed" not in read("tests.txt")
        ulps = json.loads(read("contract_ulps.json"))["results"]
        assert {r["k"] for r in ulps["fp16"] if r.get("op", "linear") == "linear"} == {64, 512}
        check_lm_verdict(read, packed)
        rows = json.loads(read("throughput.json"))["rows"]
        assert {r["status"] for r in rows} == {"ok"}
        assert [r["census_step_ratio"] > 0 for r in rows if r["scaler"] == "lab.scaling dynamic"] == [True]
        assert {"fp16", "bf16"} <= set(json.loads(read("rl_mismatch.json")))
        fp8 = json.loads(read("fp8_vs_scaled_mm.json"))  # step 6: both sets of shapes, every combination, the step time
        assert {r["set"] for r in fp8["gemms"]} == {"gpt-tiny", "k-sweep"} and {r["status"] for r in fp8["gemms"]} == {"ok"}
        assert fp8["step_time"]["status"] == "ok" and "fp8_vs_scaled_mm.md" in packed
        assert json.loads(read("eval_memory.json"))["predicted_gib"] > 0
        resnet = list(csv.DictReader(io.StringIO(read("resnet50_tiny.csv"))))
        assert [(r["mode"], r["n_seeds"]) for r in resnet] == [("fp16-dynamic", "2")]  # two seeds, one job
        assert json.loads(read("loader.json"))["images_per_s"] > 0


def check_lm_verdict(read, packed) -> None:
    """Step 3: three modes of the default study's LM, each seed's run folder brought back (no checkpoint), the summary
    set beside the committed CPU study's."""
    summary = list(csv.DictReader(io.StringIO(read("lm_summary.csv"))))
    assert {(r["mode"], r["n_seeds"]) for r in summary} == {(m, "2") for m in ("fp32", "fp16-noscale", "fp16-dynamic")}
    for mode in ("fp32", "fp16-noscale", "fp16-dynamic"):
        for seed in (12, 13):
            metrics = json.loads(read(f"lm/{mode}/seed{seed}/metrics.json"))
            assert metrics["status"] == "ok" and metrics["seed"] == seed
            provenance = json.loads(read(f"lm/{mode}/seed{seed}/provenance.json"))
            assert provenance["data"]["corpus_sha256"] == corpus_provenance("pydoc", None)["corpus_sha256"]
    assert not [n for n in packed if n.endswith(".pt")]
    table = read("lm_cuda_vs_cpu.md")
    with open(REPO / "results" / "tables" / "summary.csv") as f:  # the committed CPU study's row beside this run's
        cpu = next(r for r in csv.DictReader(f) if (r["model"], r["mode"]) == ("lm", "fp16-noscale"))
    row = next(line for line in table.splitlines() if line.startswith("| fp16-noscale |"))
    assert f"| {float(cpu['val_loss_delta']):+.4f} ± {float(cpu['val_loss_delta_ci']):.4f} ({cpu['val_loss_verdict']}) |" in row
    assert sum(line.startswith("| fp") for line in table.splitlines()) == 3

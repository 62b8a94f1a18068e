"""benchmarks/gpu_check.sh --rehearse: the prepared CUDA check run end to end on the CPU at tiny size, so that the
script a GPU session runs once has run before (issue 40). Every step must finish and write what it measures."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--rehearse"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    assert "SKIPPED" not in res.stdout, res.stdout[-3000:]
    assert " passed" in (out / "tests.txt").read_text() and "failed" not in (out / "tests.txt").read_text()
    ulps = json.loads((out / "contract_ulps.json").read_text())["results"]
    assert {r["k"] for r in ulps["fp16"]} == {64, 512}
    memory = json.loads((out / "eval_memory.json").read_text())
    assert memory["eval_batch"] == 256 and memory["predicted_gib"] > 0
    with open(out / "summary_tiny.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["mode"]) for r in rows} == {(m, d) for m in ("resnet50", "lm")
                                                      for d in ("fp32", "fp16-dynamic")}
    assert all(r["n_seeds"] == "2" for r in rows)  # two seeds forked from one process per job
    assert json.loads((out / "loader.json").read_text())["images_per_s"] > 0
    assert {r["status"] for r in json.loads((out / "throughput.json").read_text())["rows"]} == {"ok"}
    assert "gpu_check:" in (out / "env.txt").read_text()

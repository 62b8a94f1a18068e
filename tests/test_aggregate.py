import json

import pandas as pd
import pytest

from lab.aggregate import SUMMARY_COLUMNS, aggregate


def fake_run(root, model, mode, seed, top1, throughput, mem, precision="fp16", **extra):
    d = root / model / mode / f"seed{seed}"
    d.mkdir(parents=True)
    m = dict(model=model, mode=mode, seed=seed, precision=precision, scaler="static", device_name="cpu-x",
             fp16_path="n/a", final_top1=top1, final_train_loss=0.1, overflow_steps=2, skipped_steps=2, steps=10,
             update_ratio=0.8, final_scale=128.0, min_scale=128.0, max_scale=128.0, diverged=False,
             throughput_samples_per_s=throughput, peak_memory_mb=mem, activation_mb=mem / 10)
    m.update(extra)
    (d / "metrics.json").write_text(json.dumps(m))
    return d


def test_summary_columns_and_paired_numbers(tmp_path):
    dirs = [fake_run(tmp_path, "vit", "fp32", 0, 0.90, 100, 1000, precision="fp32", scaler="none"),
            fake_run(tmp_path, "vit", "fp32", 1, 0.80, 100, 1000, precision="fp32", scaler="none"),
            fake_run(tmp_path, "vit", "fp16-s", 0, 0.85, 150, 800),
            fake_run(tmp_path, "vit", "fp16-s", 1, 0.81, 250, 600, diverged=True)]
    table = aggregate(dirs, tmp_path / "t" / "summary.csv", tmp_path / "t" / "summary.md")
    assert list(table.columns) == SUMMARY_COLUMNS
    csv = pd.read_csv(tmp_path / "t" / "summary.csv")
    row = csv[csv["mode"] == "fp16-s"].iloc[0]
    assert row["n_seeds"] == 2 and row["n_diverged"] == 1
    assert row["top1_delta_vs_fp32"] == pytest.approx(((0.85 - 0.90) + (0.81 - 0.80)) / 2)
    assert row["top1_mean"] == pytest.approx(0.83)
    assert row["speedup_vs_fp32"] == pytest.approx(2.0)
    assert row["memory_saving_vs_fp32_pct"] == pytest.approx(30.0)
    assert row["skipped_pct"] == pytest.approx(20.0)
    md = (tmp_path / "t" / "summary.md").read_text().splitlines()
    assert md[0].startswith("| model | mode | FP32 top-1 % | mode top-1 % (± std) | Δ vs FP32")
    assert "final train loss | overflow steps" in md[0]
    assert "| vit | fp16-s | 85.0 | 83.0 ± 2.8 | -2.0 |" in md[3]


def test_missing_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        aggregate([tmp_path / "nope"], tmp_path / "a.csv", tmp_path / "a.md")

import json
import shutil

import jsonschema
import numpy as np
import pandas as pd
import pytest
import yaml

from lab.cli import main
from lab.core import config
from lab.study.aggregate import SUMMARY_COLUMNS, aggregate
from results_fixture import make_results


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
    assert "final train loss | act. grads flushed % | act. grads subnormal % | overflow steps (descent + in training)" in md[0]
    # Δ ± 95% t half width: diffs -0.05, +0.01 -> sd 0.042426, se 0.03, t_{0.975,1} = 12.7062 -> 38.1 pp
    assert "| vit | fp16-s | 85.0 | 83.0 ± 2.8 | -2.0 ± 38.1 |" in md[3]
    assert row["top1_delta"] == row["top1_delta_vs_fp32"] and row["top1_delta_ci"] == pytest.approx(0.381186, 1e-5)
    assert row["n_pairs"] == 2 and row["top1_verdict"] == "not resolved"
    assert pd.isna(row["val_loss_mean"]) and row["val_loss_n_pairs"] == 0  # runs predating final_val_loss


def test_missing_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        aggregate([tmp_path / "nope"], tmp_path / "a.csv", tmp_path / "a.md")


# --- paired statistics: a crafted results set where every verdict is known --------------------------------
FP32_TOP1, FP32_LOSS = [0.80, 0.85, 0.90, 0.95], [1.0, 0.9, 0.8, 0.7]
OFFSETS = {  # mode -> (top-1 offsets, val-loss offsets) per seed 0..3 against FP32 on the same seed
    "cost": ([-0.05, -0.06, -0.05, -0.06], [0.20, 0.21, 0.20, 0.21]),          # resolved costs
    "same": ([0.001, -0.001, 0.0005, -0.0005], [0.002, -0.002, 0.001, -0.001]),  # equivalent
    "noisy": ([0.05, -0.05, 0.04, -0.03], [0.3, -0.3, 0.2, -0.25]),            # not resolved
    "better": ([0.02, 0.021, 0.02, 0.021], [-0.1, -0.11, -0.1, -0.11]),         # resolved gains
}


def crafted(root):
    dirs = [fake_run(root, "m", "fp32", s, t, 100, 1000, precision="fp32", final_val_loss=v)
            for s, (t, v) in enumerate(zip(FP32_TOP1, FP32_LOSS))]
    dirs.append(fake_run(root, "m", "fp32", 9, 0.5, 100, 1000, precision="fp32", final_val_loss=3.0))  # unpaired
    for mode, (dt, dv) in OFFSETS.items():
        dirs += [fake_run(root, "m", mode, s, FP32_TOP1[s] + dt[s], 100, 1000, final_val_loss=FP32_LOSS[s] + dv[s])
                 for s in range(4)]
    dirs.append(fake_run(root, "m", "cost", 7, 0.01, 100, 1000, final_val_loss=9.0))  # unpaired: must not count
    return dirs


def test_verdicts_in_csv_and_markdown(tmp_path):
    aggregate(crafted(tmp_path), tmp_path / "s.csv", tmp_path / "s.md")
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    for mode, (dt, dv) in OFFSETS.items():
        assert t.loc[mode, "n_pairs"] == 4 and t.loc[mode, "top1_n_pairs"] == 4  # seed 7 has no FP32 partner
        assert t.loc[mode, "top1_delta"] == pytest.approx(np.mean(dt))
        assert t.loc[mode, "val_loss_delta"] == pytest.approx(np.mean(dv))
        assert t.loc[mode, "top1_delta_ci"] == pytest.approx(st_half(dt))
    expect = {"cost": ("cost resolved", "cost resolved"), "same": ("equivalent", "equivalent"),
              "noisy": ("not resolved", "not resolved"), "better": ("gain resolved", "gain resolved"),
              "fp32": ("reference", "reference")}
    for mode, (top1, loss) in expect.items():
        assert (t.loc[mode, "top1_verdict"], t.loc[mode, "val_loss_verdict"]) == (top1, loss)
    assert t.loc["cost", "top1_resolved"] and not t.loc["cost", "top1_equivalent"]
    assert t.loc["same", "top1_equivalent"] and not t.loc["same", "top1_resolved"]
    # the mean is over every run of the mode (seed 7 too); the delta is over pairs only
    assert t.loc["cost", "val_loss_mean"] == pytest.approx((sum(FP32_LOSS) + sum(OFFSETS["cost"][1]) + 9.0) / 5)
    cost_top1 = np.add(FP32_TOP1, OFFSETS["cost"][0])
    assert t.loc["cost", "top1_pair_corr"] == pytest.approx(np.corrcoef(FP32_TOP1, cost_top1)[0, 1])

    md = (tmp_path / "s.md").read_text()
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| m |")}
    assert "| **-5.5 ± 0.9** | " in rows["cost"] and "| **0.205 ± 0.009** |" in rows["cost"]
    assert "| cost resolved | cost resolved |" in rows["cost"]
    assert "| equivalent | equivalent |" in rows["same"] and "**" not in rows["same"]
    assert "| not resolved | not resolved |" in rows["noisy"] and "**" not in rows["noisy"]
    assert "| gain resolved | gain resolved |" in rows["better"]
    assert "95% Student-t interval" in md and "±1 pp top-1 and ±0.05 nats" in md and "n pairs per row: 4." in md
    header = md.splitlines()[0]
    assert header.index("Δ vs FP32") < header.index("val loss (nats)") < header.index("final train loss")


def st_half(d, confidence=0.95):
    from scipy import stats as st
    return st.t.ppf(0.5 + confidence / 2, len(d) - 1) * np.std(d, ddof=1) / np.sqrt(len(d))


def test_margins_and_confidence_come_from_the_study(tmp_path):
    dirs = [str(d) for d in crafted(tmp_path)]
    rc = main(["aggregate", *dirs, "--csv", str(tmp_path / "s.csv"), "--md", str(tmp_path / "s.md"),
               "--margin", "top1=0.0001", "--margin", "val_loss=0.5", "--confidence", "0.9"])
    assert rc == 0
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    assert t.loc["same", "top1_verdict"] == "not resolved"  # a margin of 0.01 pp is too tight to show
    assert t.loc["noisy", "val_loss_verdict"] == "equivalent"
    assert t.loc["cost", "top1_delta_ci"] == pytest.approx(st_half(OFFSETS["cost"][0], 0.9))
    md = (tmp_path / "s.md").read_text()
    assert "90% Student-t interval" in md and "±0.01 pp top-1 and ±0.5 nats" in md
    assert main(["aggregate", *dirs, "--csv", "a.csv", "--md", "a.md", "--margin", "top5=0.1"]) == 2


def test_stats_key_in_the_schema_and_defaults():
    study = yaml.safe_load(config.DEFAULT_CONFIG.read_text())
    validator = jsonschema.Draft202012Validator(config._schema())
    assert not list(validator.iter_errors({**study, "stats": {"confidence": 0.9, "margins": {"top1": 0.02}}}))
    assert list(validator.iter_errors({**study, "stats": {"margins": {"top5": 0.02}}}))
    assert list(validator.iter_errors({**study, "stats": {"alpha": 0.05}}))
    merged = config.deep_merge(config.STUDY_DEFAULTS, {"stats": {"margins": {"top1": 0.02}}})["stats"]
    assert merged == {"confidence": 0.95, "margins": {"top1": 0.02, "val_loss": 0.05}}


def test_identical_modes_are_noted_under_the_table(tmp_path):
    root = make_results(tmp_path, census=False)
    runs = root / "runs" / "resnet50"
    for new, change in (("fp16-gradnorm", None), ("fp16-otherrule", "scale")):
        for seed in (0, 1):
            d = shutil.copytree(runs / "fp16-dynamic" / f"seed{seed}", runs / new / f"seed{seed}")
            m = json.loads((d / "metrics.json").read_text())
            (d / "metrics.json").write_text(json.dumps({**m, "mode": new}))
            if change and seed == 1:  # one scale value differs in one run
                rows = [line.split(",") for line in (d / "steps.csv").read_text().splitlines()]
                col = rows[0].index("scale")
                rows[5][col] = str(2 * float(rows[5][col]))
                (d / "steps.csv").write_text("\n".join(",".join(r) for r in rows) + "\n")
    dirs = [runs / mode / f"seed{s}" for mode in ("fp32", "fp16-static128", "fp16-dynamic", "fp16-gradnorm",
                                                   "fp16-otherrule") for s in (0, 1)]
    aggregate(dirs, tmp_path / "s.csv", tmp_path / "s.md")
    md = (tmp_path / "s.md").read_text()
    assert ("fp16-gradnorm = fp16-dynamic in all 2 runs of resnet50: its rule never fired "
            "(same loss, scale and skips at every step).") in md
    assert "fp16-otherrule =" not in md

import json
import shutil

import jsonschema
import numpy as np
import pandas as pd
import pytest
import yaml

from lab.cli import main
from lab.core import config, schema
from lab.core.study import deep_merge
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
    assert ("final train loss | act. grads flushed % | act. grads subnormal % | overflow steps (descent + in "
            "training)") in md[0]
    # one mode against FP32 over 2 seeds: the pool is that mode's own 1 degree of freedom, no examples:
    # diffs -0.05, +0.01 -> var(Δ) 0.0018, se 0.03, t_{0.975,1} = 12.7062 -> 38.1 pp
    assert "| vit | fp16-s | 85.0 | 83.0 ± 2.8 | -2.0 ± 38.1 |" in md[3]
    assert row["top1_delta"] == row["top1_delta_vs_fp32"] and row["top1_delta_ci"] == pytest.approx(0.381186, 1e-5)
    assert row["top1_df"] == pytest.approx(1.0) and row["top1_spread"] == "own"   # 2 seeds: never pooled
    assert row["n_pairs"] == 2 and row["top1_verdict"] == "not resolved"
    assert pd.isna(row["val_loss_mean"]) and row["val_loss_n_pairs"] != 2  # runs predating final_val_loss
    assert "Error rate: false discovery rate 5% (Benjamini–Hochberg)" in row["error_rate"]


def test_missing_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        aggregate([tmp_path / "nope"], tmp_path / "a.csv", tmp_path / "a.md")


# --- paired statistics: a crafted results set where every verdict is known --------------------------------
FP32_TOP1, FP32_LOSS = [0.80, 0.85, 0.90, 0.95], [1.0, 0.9, 0.8, 0.7]
OFFSETS = {  # mode -> (top-1 offsets, val-loss offsets) per seed 0..3 against FP32 on the same seed
    "cost": ([-0.05, -0.051, -0.05, -0.051], [0.20, 0.21, 0.20, 0.21]),        # resolved costs
    "same": ([0.001, -0.001, 0.0005, -0.0005], [0.004, -0.004, 0.003, -0.003]),  # equivalent
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


def ols_pool(modes):
    """The pooled residual variance and its degrees of freedom of y ~ C(mode) + C(seed) (statsmodels OLS) over
    FP32 and `modes`, top-1 and validation loss: the reference the aggregate's two-way formula must match."""
    import statsmodels.formula.api as smf
    out = {}
    for k, base in ((0, FP32_TOP1), (1, FP32_LOSS)):
        rows = [{"mode": "fp32", "seed": s, "y": base[s]} for s in range(4)]
        rows += [{"mode": m, "seed": s, "y": base[s] + OFFSETS[m][k][s]} for m in modes for s in range(4)]
        fit = smf.ols("y ~ C(mode) + C(seed)", pd.DataFrame(rows)).fit()
        out[k] = (fit.mse_resid, fit.df_resid)
    return out


def bh(p):
    """Benjamini–Hochberg q-values, written out."""
    p = np.asarray(p, float)
    order = np.argsort(p)
    m = len(p)
    q = np.minimum.accumulate((p[order] * m / np.arange(1, m + 1))[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(q, 1)
    return out


def test_verdicts_in_csv_and_markdown(tmp_path):
    from scipy import stats as st
    aggregate(crafted(tmp_path), tmp_path / "s.csv", tmp_path / "s.md")
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    pooled = [m for m in OFFSETS if m != "noisy"]
    ref = ols_pool(pooled)
    p = {}
    for mode, (dt, dv) in OFFSETS.items():
        assert t.loc[mode, "n_pairs"] == 4 and t.loc[mode, "top1_n_pairs"] == 4  # seed 7 has no FP32 partner
        for k, name, d in ((0, "top1", dt), (1, "val_loss", dv)):
            assert t.loc[mode, f"{name}_delta"] == pytest.approx(np.mean(d))
            if mode == "noisy":  # its spread is far larger than the others': its own, 3 degrees of freedom
                assert t.loc[mode, f"{name}_spread"] == "own" and t.loc[mode, f"{name}_df"] == pytest.approx(3)
                var, df = np.var(d, ddof=1), 3
            else:                # the family's pool: the two-way model's residual, as statsmodels fits it
                mse, df = ref[k]
                var = 2 * mse
                assert t.loc[mode, f"{name}_spread"] == "pooled" and t.loc[mode, f"{name}_df"] == pytest.approx(df)
            se = np.sqrt(var / 4)
            assert t.loc[mode, f"{name}_se"] == pytest.approx(se)
            assert t.loc[mode, f"{name}_delta_ci"] == pytest.approx(st.t.ppf(0.975, df) * se)
            p[(mode, name)] = 2 * st.t.sf(abs(np.mean(d)) / se, df)
            assert t.loc[mode, f"{name}_p"] == pytest.approx(p[(mode, name)])
    q = dict(zip(p, bh(list(p.values()))))
    for key, qv in q.items():
        assert t.loc[key[0], f"{key[1]}_q"] == pytest.approx(qv)
    expect = {"cost": ("cost", "cost"), "same": ("equivalent", "equivalent"),
              "noisy": ("not resolved", "not resolved"), "better": ("gain", "gain"),
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
    assert "| **-5.1 ± 0.1** | " in rows["cost"] and "| cost | cost |" in rows["cost"]
    assert "(90%)" in rows["same"] and "**" not in rows["same"] and "| equivalent | equivalent |" in rows["same"]
    assert "| not resolved" in rows["noisy"] and "**" not in rows["noisy"]
    assert "| gain | gain |" in rows["better"]
    assert "false discovery rate 5% (Benjamini–Hochberg) across this table's 8 difference tests" in md
    assert "n pairs per row: 4." in md
    header = md.splitlines()[0]
    assert header.index("Δ vs FP32") < header.index("val loss (nats)") < header.index("final train loss")


def test_a_resolved_difference_inside_the_margin_is_negligible(tmp_path):
    dirs = crafted(tmp_path)
    dirs += [fake_run(tmp_path, "m", "tiny", s, FP32_TOP1[s] - 0.002, 100, 1000,
                      final_val_loss=FP32_LOSS[s] + 0.02 + 0.0005 * (-1) ** s) for s in range(4)]
    aggregate(dirs, tmp_path / "s.csv", tmp_path / "s.md")
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    assert t.loc["tiny", "val_loss_verdict"] == "negligible"
    assert t.loc["tiny", "val_loss_resolved"] and t.loc["tiny", "val_loss_equivalent"]


def test_a_diverged_run_counts_as_a_uniform_guess(tmp_path):
    """A diverged seed is a result: its non-finite loss counts as ln C, never dropped."""
    import math
    dirs = crafted(tmp_path)
    dirs += [fake_run(tmp_path, "m", "boom", s, 0.1, 100, 1000, num_classes=10, diverged=s == 0,
                      final_val_loss=math.nan if s == 0 else FP32_LOSS[s]) for s in range(4)]
    aggregate(dirs, tmp_path / "s.csv", tmp_path / "s.md")
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    assert t.loc["boom", "n_diverged"] == 1 and t.loc["boom", "val_loss_n_pairs"] == 4
    assert t.loc["boom", "val_loss_delta"] == pytest.approx((math.log(10) - FP32_LOSS[0]) / 4)


def test_margins_come_from_the_declared_block_and_the_study(tmp_path):
    dirs = [str(d) for d in crafted(tmp_path)]
    claims = tmp_path / "claims.yaml"
    claims.write_text(yaml.safe_dump({"declared": {"m": {"top1": {"margin": 0.0001, "reason": "r"}}},
                                      "claims": [{"id": "x", "text": "t", "source": "s",
                                                  "cost": {"model": "m", "mode": "cost", "metric": "top1"}}]}))
    rc = main(["aggregate", *dirs, "--csv", str(tmp_path / "s.csv"), "--md", str(tmp_path / "s.md"),
               "--margin", "val_loss=0.5", "--confidence", "0.9", "--declared", str(claims)])
    assert rc == 0
    t = pd.read_csv(tmp_path / "s.csv").set_index("mode")
    assert t.loc["same", "top1_margin"] == 0.0001 and t.loc["same", "val_loss_margin"] == 0.5
    assert t.loc["same", "top1_verdict"] == "not resolved"  # a margin of 0.01 pp is too tight to show
    assert t.loc["noisy", "val_loss_verdict"] == "equivalent"
    from scipy import stats as st
    assert t.loc["cost", "top1_delta_ci"] == pytest.approx(st.t.ppf(0.95, t.loc["cost", "top1_df"])
                                                          * t.loc["cost", "top1_se"])
    md = (tmp_path / "s.md").read_text()
    assert "90% interval" in md and "false discovery rate 10%" in md and "m ±0.01 pp top-1, ±0.5 nats" in md
    assert main(["aggregate", *dirs, "--csv", "a.csv", "--md", "a.md", "--margin", "top5=0.1"]) == 2


def test_stats_key_in_the_schema_and_defaults():
    study = yaml.safe_load(config.DEFAULT_CONFIG.read_text())
    validator = jsonschema.Draft202012Validator(schema.schema())
    assert not list(validator.iter_errors({**study, "stats": {"confidence": 0.9, "margins": {"top1": 0.02}}}))
    assert list(validator.iter_errors({**study, "stats": {"margins": {"top5": 0.02}}}))
    assert list(validator.iter_errors({**study, "stats": {"alpha": 0.05}}))
    merged = deep_merge(config.STUDY_DEFAULTS, {"stats": {"margins": {"top1": 0.02}}})["stats"]
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


def test_overflow_rate_is_pooled_with_an_exact_interval_that_is_never_zero_wide(tmp_path):
    """One in-training overflow in 200 steps on each of two seeds: the seeds agree exactly (a t interval over them
    has zero width), the pooled rate 5/1k has the exact Poisson interval of 2 events in 400 steps."""
    from statsmodels.stats.rates import confint_poisson
    dirs = [fake_run(tmp_path, "lm", "fp32", s, 0.5, 100, 1000, precision="fp32", scaler="none") for s in (0, 1)]
    dirs += [fake_run(tmp_path, "lm", "fp16-d", s, 0.5, 100, 1000, overflow_in_training=1, overflow_initial=3,
                      steps_after_first_clean=200, overflow_per_1k=5.0) for s in (0, 1)]
    table = aggregate(dirs, tmp_path / "t" / "summary.csv", tmp_path / "t" / "summary.md").set_index("mode")
    low, high = (1000 * b for b in confint_poisson(2, 400, method="exact-c"))
    row = table.loc["fp16-d"]
    assert row["overflow_per_1k"] == pytest.approx(5.0) and row["overflow_per_1k_sd"] == 0
    assert (row["overflow_per_1k_low"], row["overflow_per_1k_high"]) == (pytest.approx(low), pytest.approx(high))
    assert row["overflow_count"] == 2 and row["overflow_exposure"] == 400
    md = (tmp_path / "t" / "summary.md").read_text()
    assert f"| 3.0 + 1.0 | 5.00 ({low:.2f}–{high:.2f}) |" in md and "exact (Garwood) Poisson interval" in md

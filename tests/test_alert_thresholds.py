"""The alert-threshold study (lab/diagnose/alerts.py, alert_tables.py; the claims kind lab/study/claims/detection.py;
docs/alerts.md): the detectors counted exactly from synthetic steps.csv, each run's outcome against its FP32 twin and
its study's declared margin, the rates' counts and intervals, the claims kind calibrated by simulation under the
null, and the command's refusals of bad input (one line, exit status 2)."""
import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from conftest import tiny_study
from lab.cli import main
from lab.diagnose import alert_tables, alerts
from lab.study import claims
from lab.study.claims import detection


def write_run(root, model, mode, seed, skipped, found=None, val_loss=1.0, precision="fp16", scaler="static",
              status="ok", cut=False):
    """A finished run folder: metrics.json and steps.csv with the given per-step skipped / found_inf flags."""
    found = skipped if found is None else found
    d = root / model / mode / f"seed{seed}"
    d.mkdir(parents=True)
    lines = ["step,loss,scale,found_inf,skipped"] + [f"{i},1.0,128.0,{int(f)},{int(s)}"
                                                     for i, (s, f) in enumerate(zip(skipped, found))]
    text = "\n".join(lines) + "\n"
    (d / "steps.csv").write_text(text[:-1] if cut else text)
    (d / "metrics.json").write_text(json.dumps(
        dict(model=model, mode=mode, seed=seed, precision=precision, scaler=scaler, status=status,
             diverged=status == "diverged", final_val_loss=val_loss, steps=len(skipped), num_classes=10)))
    return d


def reference_streaks(skipped, found):
    """The same numbers the plain way: runs of True by itertools.groupby."""
    def longest(flags):
        return max((len(list(g)) for k, g in itertools.groupby(flags) if k), default=0)
    first = next((i for i, f in enumerate(found) if not f), len(found))
    return longest(skipped), longest(skipped[first:]), sum(skipped)


# --- the detectors' inputs ------------------------------------------------------------------------------------------
def test_streaks_from_a_synthetic_steps_csv_are_exact(tmp_path):
    d = write_run(tmp_path, "m", "fp16-dynamic", 0, [1, 1, 1, 0, 1, 0, 0, 1, 1, 0])
    r = alerts.read_run(d)
    # the descent: 3 skipped steps, then a clean one; after it, a single skip and a pair
    assert (r["longest_skip_streak"], r["longest_streak_in_training"], r["skipped_steps"], r["steps"]) == (3, 2, 6, 10)
    assert r["update_ratio"] == pytest.approx(0.4)
    # overflows applied anyway (policy none): nothing skipped, no streak
    r = alerts.read_run(write_run(tmp_path, "m", "fp16-noscale", 0, [0, 0, 0], found=[1, 0, 1], scaler="none"))
    assert (r["longest_skip_streak"], r["longest_streak_in_training"], r["update_ratio"]) == (0, 0, 1.0)
    # every step skipped: no clean step, so no streak after one
    r = alerts.read_run(write_run(tmp_path, "m", "fp16-all", 0, [1] * 7))
    assert (r["longest_skip_streak"], r["longest_streak_in_training"], r["update_ratio"]) == (7, 0, 0.0)


def test_streaks_equal_the_plain_count_on_random_step_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        found = list(rng.random(n) < rng.random())
        skipped = [f and rng.random() < 0.9 for f in found]
        r = alerts.skip_streaks(skipped, found)
        assert (r["longest_skip_streak"], r["longest_streak_in_training"], r["skipped_steps"]) == \
            reference_streaks(skipped, found)


@pytest.mark.parametrize("counts, expected", [
    ((0, 0, 0, 0), 0.0),      # nothing skipped
    ((5, 7, 3, 4), 5.0),      # the longest streak is longer than the descent: it came after it
    ((4, 5, 4, 1), 1.0),      # one overflow in training: a streak of one
    ((4, 6, 4, 2), math.nan),  # two in training, the longest is the descent's: unknown
])
def test_the_streak_after_the_descent_from_a_tables_counts(counts, expected):
    got = alerts.in_training_from_counts(*counts)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


# --- outcomes -------------------------------------------------------------------------------------------------------
@pytest.fixture
def study(tmp_path):
    """A study config (vit's val_loss margin declared 0.02 in its claims file; resnet50's from stats: 0.1) and
    its results folder."""
    results = tmp_path / "results" / "s"
    cfg = tiny_study(results_dir=str(results), claims_file=str(tmp_path / "claims_s.yaml"))
    cfg["stats"] = {"margins": {"top1": 0.01, "val_loss": 0.1}}
    cfg["modes"] = {"fp32": {"precision": "fp32"},
                    "fp16-s": {"precision": "fp16", "scaler": {"policy": "static", "scale": 128}},
                    "fp16-n": {"precision": "fp16", "scaler": {"policy": "none"}}}
    (tmp_path / "claims_s.yaml").write_text(yaml.safe_dump({
        "declared": {"vit": {"val_loss": {"margin": 0.02, "reason": "test"}}},
        "claims": [{"id": "x", "text": "t", "source": "s", "bound": {"model": "vit", "mode": "fp16-s",
                                                                      "metric": "val_loss", "at_most": 1}}]}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    return results / "runs", str(tmp_path / "s.yaml")


def test_outcomes_against_the_fp32_twin_and_the_declared_margin(study):
    runs, config = study
    write_run(runs, "vit", "fp32", 0, [0] * 4, val_loss=1.0, precision="fp32", scaler="none")
    write_run(runs, "vit", "fp16-s", 0, [1, 0, 0, 0], val_loss=1.03)                     # +0.03 > 0.02: worse
    write_run(runs, "vit", "fp16-n", 0, [0] * 4, val_loss=0.95, scaler="none")            # -0.05: better
    write_run(runs, "vit", "fp16-s", 1, [0] * 4, val_loss=1.5)                            # no FP32 seed 1
    write_run(runs, "resnet50", "fp32", 0, [0] * 4, val_loss=1.0, precision="fp32", scaler="none")
    write_run(runs, "resnet50", "fp16-s", 0, [0] * 4, val_loss=1.05)                      # +0.05 <= 0.1 (stats)
    write_run(runs, "resnet50", "fp16-n", 0, [0] * 4, val_loss=9.0, status="diverged", scaler="none")
    t = alerts.collect([str(runs / "*" / "*" / "seed*")], [config]).set_index(["model", "mode", "seed"])
    assert t.loc[("vit", "fp16-s", 0), ["outcome", "worse", "margin"]].tolist() == ["worse", 1, 0.02]
    assert t.loc[("vit", "fp16-s", 0), "delta"] == pytest.approx(0.03)
    assert t.loc[("vit", "fp16-n", 0), ["outcome", "worse", "loss_scaled"]].tolist() == ["better", 0, 0]
    assert t.loc[("vit", "fp16-s", 1), "outcome"] == "no FP32 twin" and math.isnan(t.loc[("vit", "fp16-s", 1), "worse"])
    assert t.loc[("resnet50", "fp16-s", 0), ["outcome", "worse", "margin", "loss_scaled"]].tolist() == \
        ["equivalent", 0, 0.1, 1]
    assert t.loc[("resnet50", "fp16-n", 0), ["outcome", "worse"]].tolist() == ["diverged", 1]
    assert t.loc[("vit", "fp32", 0), "outcome"] == "reference" and set(t["study"]) == {"s"}
    assert t.loc[("vit", "fp16-s", 0), "cluster"] == "s/seed0"


def test_a_run_read_from_its_folder_and_its_studys_table_is_one_run(study):
    runs, config = study
    write_run(runs, "vit", "fp32", 0, [0] * 4, val_loss=1.0, precision="fp32", scaler="none")
    d = write_run(runs, "vit", "fp16-s", 0, [1, 1, 0, 1], val_loss=1.0)
    tables = runs.parent / "tables"
    tables.mkdir()
    pd.DataFrame([dict(model="vit", mode=m, seed=0, val_loss=1.0, diverged=0, steps=4, skipped_steps=k,
                       update_ratio=1 - k / 4, max_consecutive_skips=k, overflow_initial=k, overflow_in_training=0)
                  for m, k in (("fp32", 0), ("fp16-s", 3), ("fp16-n", 0))]).to_csv(tables / "runs.csv", index=False)
    t = alerts.collect([str(runs / "*" / "*" / "seed*"), str(tables / "runs.csv")], [config])
    assert len(t) == 3
    row = t.set_index("mode").loc["fp16-s"]
    assert row["read_from"] == str(d) and row["longest_skip_streak"] == 2  # the folder's, not the table's 3
    assert t.set_index("mode").loc["fp16-n", "read_from"].endswith("runs.csv")


# --- rates ----------------------------------------------------------------------------------------------------------
def frame(rows):
    return pd.DataFrame(rows, columns=["cluster", "x", "worse"]).assign(study="s", loss_scaled=1)


def test_rates_count_exactly_with_wilson_and_cluster_intervals():
    # cluster a: two fired runs, one worse (mixed); b: fired and worse; c: a worse run it misses; d: quiet
    runs = frame([("a", 5, 1), ("a", 4, 0), ("b", 3, 1), ("c", 0, 1), ("d", 1, 0), ("d", 0, 0)])
    r = alert_tables.rates(runs, "x", "at_least", 3)
    assert (r["tp"], r["fp"], r["fn"], r["tn"], r["fired"], r["worse"]) == (2, 1, 1, 2, 3, 3)
    assert r["precision"] == pytest.approx(2 / 3) and r["recall"] == pytest.approx(2 / 3)
    z = st.norm.ppf(0.975)  # Wilson's interval, written out
    centre, half = (2 + z * z / 2) / (3 + z * z), z / (3 + z * z) * math.sqrt(2 * 1 / 3 + z * z / 4)
    assert (r["precision_wilson_low"], r["precision_wilson_high"]) == pytest.approx((centre - half, centre + half))
    # precision's clusters a, b: a counts as a hit only when any may (1-2 of 2); recall's a, b, c: 2 of 3 either way
    assert r["precision_clusters"] == 2 and r["recall_clusters"] == 3
    assert r["precision_cluster_low"] == pytest.approx(st.binomtest(1, 2).proportion_ci(0.95, "exact").low)
    assert r["precision_cluster_high"] == 1.0
    assert detection.units(runs, {"column": "x", "fires": {"at_least": 3}}, "precision")[:3] == (2, 1, 2)


def test_the_choice_says_when_the_data_cannot_choose():
    # no worse run ever fires in either half: nothing to choose from
    runs = frame([(f"c{i}", 0, i % 2) for i in range(8)]).assign(longest_skip_streak=0,
                                                                 longest_streak_in_training=0, update_ratio=1.0)
    table = alert_tables.choose(runs)
    assert set(table["chosen"]) == {"cannot choose"}


# --- the claims kind: calibrated by simulation -----------------------------------------------------------------------
def simulate(rng, n_clusters, rate, rho, max_size=3):
    """Clusters of 1..max_size fired runs; with probability rho a cluster's runs share one Bernoulli(rate) outcome,
    else each has its own: every run is worse with probability ``rate`` (the cluster-weighted precision)."""
    rows = []
    for c in range(n_clusters):
        size = int(rng.integers(1, max_size + 1))
        shared = rng.random() < rate
        for _ in range(size):
            worse = shared if rng.random() < rho else rng.random() < rate
            rows.append((f"c{c}", 1, int(worse)))
    return frame(rows)


@pytest.mark.study  # a calibration by simulation (~20 s): `make test-studies`, with the claims engine's others
@pytest.mark.parametrize("bound, rate", [("precision_at_least", 0.5), ("precision_at_most", 0.2)])
@pytest.mark.parametrize("rho", [0.0, 0.7, 1.0])
def test_detects_keeps_its_level_under_the_null(bound, rate, rho):
    """At a true rate equal to the declared bound, with runs correlated within clusters, the kind supports the
    claim at most at the declared level (within 3 Monte Carlo standard errors)."""
    rng, level, reps = np.random.default_rng(1), 0.05, 600
    spec = {"column": "x", "fires": {"at_least": 1}, bound: rate}
    reach = {"level": level, "max_seeds": 20}
    hits = sum(detection.detects(spec, {"runs": simulate(rng, 30, rate, rho)}, reach).p_support <= level
               for _ in range(reps))
    assert hits / reps <= level + 3 * math.sqrt(level * (1 - level) / reps)


def test_counting_runs_as_independent_would_not_keep_the_level():
    """The mutation the clusters guard against: the same null, every run a trial of its own (runs of a cluster
    share their outcome), supports the claim far more often than the level."""
    rng, level, reps, hits = np.random.default_rng(2), 0.05, 400, 0
    for _ in range(reps):
        runs = simulate(rng, 30, 0.5, 1.0)
        k, n = int(runs["worse"].sum()), len(runs)
        hits += st.binom.sf(k - 1, n, 0.5) <= level
    assert hits / reps > 2 * level


def test_detects_decides_in_the_claims_file_through_the_engine():
    """configs/claims_alerts.yaml on a table where three skips flag ten clusters' runs, all worse: its precision
    claim is supported through the engine's Holm family; one that never fires is out of reach."""
    rows = [dict(model="m", mode="a", seed=i, cluster=f"s/seed{i}", worse=1, longest_skip_streak=3,
                 update_ratio=0.99, loss_scaled=1) for i in range(10)]
    rows += [dict(model="m", mode="b", seed=i, cluster=f"s/seed{i}", worse=0, longest_skip_streak=0,
                  update_ratio=1.0, loss_scaled=1) for i in range(10)]
    cfg = claims.load_file("configs/claims_alerts.yaml", reads="runs")
    records = {r["id"]: r for r in claims.evaluate(cfg, {"runs": pd.DataFrame(rows)})}
    assert records["three-skips-alert"]["verdict"] == "supported"
    assert records["ten-skips-fallback"]["verdict"] == "out of reach"
    assert records["three-skips-catch-most"]["verdict"] == "supported"
    assert all(r["verdict"] in claims.VERDICTS for r in records.values())


def test_a_bad_detects_claim_names_what_is_wrong():
    runs = frame([("a", 1, 1)])
    with pytest.raises(claims.ClaimsError, match="exactly one of precision_at_least"):
        detection.detects({"column": "x", "fires": {"at_least": 1}}, {"runs": runs}, {"level": 0.05})
    with pytest.raises(claims.ClaimsError, match="detects.fires must map"):
        detection.detects({"column": "x", "fires": {"over": 1}, "precision_at_least": 0.5}, {"runs": runs},
                          {"level": 0.05})


# --- the command's bad input -----------------------------------------------------------------------------------------
def refused(capsys, *argv):
    rc = main(["alert-thresholds", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_the_command_refuses_bad_input_in_one_line(study, tmp_path, capsys):
    runs, config = study
    out = tmp_path / "out"
    assert "matches no run directory" in refused(capsys, tmp_path / "nothing*", "--out", out, "--configs", config)
    (tmp_path / "notes.txt").write_text("x\n")
    assert "neither a finished run directory" in refused(capsys, tmp_path / "notes.txt", "--out", out,
                                                         "--configs", config)
    (tmp_path / "unfinished").mkdir()
    assert "unfinished: neither" in refused(capsys, tmp_path / "unfinished", "--out", out, "--configs", config)
    cut = write_run(runs, "vit", "fp16-s", 0, [0, 1], cut=True)
    err = refused(capsys, cut, "--out", out, "--configs", config)
    assert "steps.csv, line 3: cut short" in err
    elsewhere = write_run(tmp_path / "elsewhere", "vit", "fp16-s", 0, [0, 1])
    assert "under no study's results_dir" in refused(capsys, elsewhere, "--out", out, "--configs", config)
    rl = runs.parent / "tables" / "runs.csv"
    rl.parent.mkdir()
    rl.write_text("mode,seed,steps,skipped_steps\nfp32,0,60,0\n")   # the RL study's table: no model, no streak
    assert "missing column(s) model" in refused(capsys, rl, "--out", out, "--configs", config)
    assert not out.exists()


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(extra=1), "expected keys"),
    (lambda d: d["alerts"].update(runs="results/runs"), "alerts.runs: expected a list"),
    (lambda d: d.update(device="cuda"), "device"),
])
def test_the_study_config_is_checked(edit, match):
    data = yaml.safe_load(open("configs/alerts.yaml"))
    edit(data)
    with pytest.raises(alerts.ConfigError, match=match):
        alerts.load_alerts(data)

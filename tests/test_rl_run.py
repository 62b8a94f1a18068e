"""A GRPO run of the RL study end to end (lab/rl/grpo_run.py): the base pre-trained, a run recorded under a loss scaler
with its per-step mismatch, read by lab diagnose; bad modes refused in one line."""
import csv
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from lab.cli import main
from lab.diagnose import diagnose
from lab.rl import task

#: rl_steps.csv's first columns, those the RL study's runs were written with
STUDY_COLUMNS = ["step", "reward", "loss", "clipped", "abs_mean", "abs_p99", "abs_max", "k1", "k3", "out_of_band",
                 "out_of_half_double", "ess", "seq_abs_mean"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "base.pt"
    assert main(["rl-base", "--out", str(out), "--steps", "100"]) == 0
    return out


def test_a_grpo_run_is_recorded_and_diagnosed(tmp_path, base):
    out = tmp_path / "run"
    assert main(["rl-train", "--mode", "fp16-gradscaler", "--base", str(base), "--out", str(out), "--steps", "12",
                 "--divisor", "4"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 12 and metrics["precision"] == "fp16"
    assert metrics["sampler"] == "fp16" and metrics["divisor"] == 4 and 0 <= metrics["solved_end"] <= 1
    assert metrics["census_fp32_replays"] == 2  # steps 0 and 10: the step's batch replayed in FP32
    with open(out / "rl_steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(12))
    assert all(0 < float(r["abs_mean"]) < 0.1 and 0 <= float(r["reward"]) <= 1 for r in rows)
    assert list(rows[0])[:13] == STUDY_COLUMNS  # the mismatch's further columns are appended after the study's
    for r in rows:  # verl's names: the same numbers as the study's k1 and k3; nested bands; ESS by Cauchy-Schwarz
        assert (r["kl"], r["k3_kl"], r["out_of_c2"]) == (r["k1"], r["k3"], r["out_of_half_double"])
        assert float(r["out_of_c5"]) <= float(r["out_of_c3"]) <= float(r["out_of_c2"]) <= 1
        tokens = 16 * 8 * task.ANSWER_LEN  # configs/rl.yaml: prompts x group x length bounds a step's tokens
        assert 0 < float(r["rollout_is_eff_sample_size"]) <= 1 + 4 * tokens * torch.finfo(torch.float64).eps
        assert math.isfinite(float(r["chi2_seq"])) and float(r["p_abs_diff_max"]) > 0
        # per sample, |sum_t d_t| <= sum_t |d_t|, at most ANSWER_LEN tokens: a mean over samples, not the batch's sum
        bound = task.ANSWER_LEN * float(r["abs_mean"]) * (1 + 4 * tokens * torch.finfo(torch.float64).eps)
        assert float(r["seq_abs_mean"]) <= bound
    d = diagnose(out)
    assert d.steps == 12 and d.fp16_loss is not None  # underflow measured through the run's replay


def test_fp32_in_both_paths_has_fp32s_mismatch_only(tmp_path, base):
    out = tmp_path / "fp32"
    assert main(["rl-train", "--mode", "fp32", "--base", str(base), "--out", str(out), "--steps", "3"]) == 0
    assert json.loads((out / "metrics.json").read_text())["mismatch_abs_mean"] < 1e-5


def test_bad_modes_are_refused_in_one_line(tmp_path, base, capsys):
    bad = tmp_path / "rl.yaml"
    for text, said in (("modes: {m: {sampler: fp8}}", "sampler must be one of fp32, bf16, fp16"),
                       ("modes: {m: {learner: bf16, scaler: {policy: dynamic}}}", "a loss scaler needs an fp16 learner"),
                       ("modes: {m: {sampler: fp16, temperature: 2}}", "unknown key(s) ['temperature']"),
                       ("modes: {m: {loss: ppo}}", "loss must be grpo or grpo-tis")):
        bad.write_text(text)
        assert main(["rl-train", "--config", str(bad), "--mode", "m", "--base", str(base),
                     "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert main(["rl-train", "--mode", "nonesuch", "--base", str(base), "--out", str(tmp_path / "y")]) == 2
    assert "not in configs/rl.yaml" in capsys.readouterr().err


def test_the_rl_study_runs_through_snakemake_and_is_then_up_to_date(repo_copy):
    """`snakemake --configfile` of an RL config (study: rl) trains the base, each (mode, seed) run and the table; a
    second dry run has nothing to do."""
    import csv as csv_module

    from test_workflow import snakemake
    (repo_copy / "configs" / "claims_tiny.yaml").write_text(
        "claims:\n  - {id: order, text: t, source: s, order: {column: mismatch_abs_mean, modes: [fp32, fp16-gradscaler]}}\n"
        "  - {id: length, text: t, source: s, greater_within: {table: shape, larger: seq_abs_48, smaller: seq_abs_8}}\n")
    (repo_copy / "configs" / "rl_tiny.yaml").write_text(
        "study: rl\nresults_dir: results/rl-tiny\nseeds: [0, 1]\nbase: {steps: 50}\n"
        "train: {steps: 4, divisor: 16, census_every: 2}\nclaims: configs/claims_tiny.yaml\nshape: {seeds: [5]}\n"
        "modes:\n  fp32: {sampler: fp32, learner: fp32, scaler: null}\n"
        "  fp16-gradscaler: {sampler: fp16, learner: fp16, scaler: {policy: dynamic}}\n"
        "  long: {sampler: fp16, learner: fp16, scaler: {policy: dynamic}, train: {steps: 6, divisor: 0.5}, seeds: [3],"
        " reference: fp16-gradscaler}\n")
    res = snakemake(repo_copy, "--cores", "2", "--configfile", "configs/rl_tiny.yaml")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(repo_copy / "results" / "rl-tiny" / "tables" / "summary.csv") as f:
        rows = {r["mode"]: r for r in csv_module.DictReader(f)}
    assert set(rows) == {"fp32", "fp16-gradscaler", "long"} and rows["fp16-gradscaler"]["seeds"] == "2"
    assert rows["fp32"]["delta_vs_fp32"] == "" or rows["fp32"]["delta_vs_fp32"] == "nan"
    # a mode's own length, divisor and seeds; its reference shares no seed with it: no Δ
    assert (rows["long"]["steps"], float(rows["long"]["divisor"]), rows["long"]["seeds"]) == ("6", 0.5, "1")
    assert rows["long"]["delta_vs_fp32"] in ("", "nan")
    with open(repo_copy / "results" / "rl-tiny" / "runs" / "long" / "seed3" / "rl_steps.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
    with open(repo_copy / "results" / "rl-tiny" / "tables" / "runs.csv") as f:
        assert sorted((r["mode"], r["seed"]) for r in csv_module.DictReader(f)) == [
            ("fp16-gradscaler", "0"), ("fp16-gradscaler", "1"), ("fp32", "0"), ("fp32", "1"), ("long", "3")]
    claims_md = (repo_copy / "results" / "rl-tiny" / "tables" / "claims.md").read_text()
    assert "**order**" in claims_md and "**length**" in claims_md
    assert (repo_copy / "results" / "rl-tiny" / "logs" / "train" / "fp32" / "seed1.log").is_file()
    for name in ("reward.png", "mismatch_hist.png", "scale.png"):  # the figures, from the same runs
        assert (repo_copy / "results" / "rl-tiny" / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(repo_copy / "results" / "rl-tiny" / "runs" / "fp16-gradscaler" / "seed0" / "rl_mismatch_hist.csv") as f:
        counts = [int(r["tokens"]) for r in csv.DictReader(f)]
    with open(repo_copy / "results" / "rl-tiny" / "runs" / "fp16-gradscaler" / "seed0" / "rl_steps.csv") as f:
        assert sum(counts) > 0 and len(list(csv.DictReader(f))) == 4
    assert "Nothing to be done" in snakemake(repo_copy, "-n", "--configfile", "configs/rl_tiny.yaml").stdout
    # a fresh clone has the committed tables but not the runs (ignored): it trains them again, not "up to date"
    shutil.move(repo_copy / "results" / "rl-tiny" / "runs", repo_copy / "runs-aside")
    dry = snakemake(repo_copy, "-n", "--configfile", "configs/rl_tiny.yaml").stdout
    assert "rl_train" in dry and "rl_shape" in dry and "rl_claims" in dry, dry[-2000:]
    shutil.move(repo_copy / "runs-aside", repo_copy / "results" / "rl-tiny" / "runs")
    # editing one mode's line reruns that mode's runs (and the tables), not the others
    text = (repo_copy / "configs" / "rl_tiny.yaml").read_text().replace("divisor: 0.5}", "divisor: 0.25}")
    (repo_copy / "configs" / "rl_tiny.yaml").write_text(text)
    dry = snakemake(repo_copy, "-n", "--configfile", "configs/rl_tiny.yaml").stdout
    trained = [line.split()[-1] for line in dry.splitlines() if line.strip().startswith("output:")
               and line.strip().endswith("metrics.json")]
    assert trained == ["results/rl-tiny/runs/long/seed3/metrics.json"], dry[-2000:]
    assert "RL study, 3 modes, 5 GRPO runs" in subprocess.run(
        [sys.executable, "-m", "lab", "validate", "--config", "configs/rl_tiny.yaml"], cwd=repo_copy,
        capture_output=True, text=True).stdout


def test_a_finished_run_or_a_missing_base_is_refused_in_one_line(tmp_path, base, capsys):
    out = tmp_path / "run"
    assert main(["rl-train", "--mode", "fp32", "--base", str(base), "--out", str(out), "--steps", "1"]) == 0
    capsys.readouterr()
    assert main(["rl-train", "--mode", "fp32", "--base", str(base), "--out", str(out), "--steps", "1"]) == 2
    assert "holds a finished run" in capsys.readouterr().err
    assert main(["rl-train", "--mode", "fp32", "--base", str(tmp_path / "none.pt"), "--out", str(tmp_path / "b")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_table_refuses_a_missing_or_foreign_run_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(f"study: rl\nresults_dir: {tmp_path}/res\nseeds: [0]\nmodes:\n  fp32: {{sampler: fp32}}\n")
    args = ["rl-aggregate", "--config", str(cfg), "--csv", str(tmp_path / "t.csv"), "--md", str(tmp_path / "t.md")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "runs/fp32/seed0/metrics.json is missing" in err and len(err.splitlines()) == 1, err
    (tmp_path / "res" / "runs" / "fp32" / "seed0").mkdir(parents=True)
    (tmp_path / "res" / "runs" / "fp32" / "seed0" / "metrics.json").write_text('{"accuracy_end": 0.5}\n')
    assert main(args) == 2
    assert "not an RL run's metrics (no solved_end)" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()

"""A tiny end-to-end Snakemake run in a temporary copy of the repository, and the README's "Add a scaling policy"
done exactly as written on it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from conftest import REPO, tiny_study
from test_figures import check_figures_and_report

BIN = Path(sys.executable).parent


def snakemake(cwd, *args, timeout=600):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def readme_blocks():
    text = (REPO / "README.md").read_text()
    section = text.split("## Add a scaling policy", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_study_end_to_end_a_new_policy_as_the_readme_says_and_selective_rerun(repo_copy):
    """The README's commands on a tiny study standing in for configs/default.yaml (modes last, as in the shipped
    file): `snakemake --cores 2` writes every table, figure and the report; then the README's two steps of "Add a
    scaling policy" (its policy file, its mode line) make the same command train only the new mode's runs; then
    editing one mode re-runs exactly that mode's jobs. One study for the three: each costs a whole study's
    start-up and reports otherwise."""
    study = tiny_study(compare=[["fp16-static128", "fp32"]])
    config = repo_copy / "configs" / "default.yaml"
    config.write_text(yaml.safe_dump(study, sort_keys=False))
    assert list(yaml.safe_load(config.read_text()))[-1] == "modes"
    res = snakemake(repo_copy, "--cores", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    tables = repo_copy / "results" / "tables"
    # replay: the FP16 mode replayed on every run, and checked against its real run on the FP32 runs
    replayed = pd.read_csv(tables / "replay.csv")
    assert len(replayed) == len(study["models"]) * len(study["modes"]) and set(replayed["policy"]) == {"static"}
    agree = pd.read_csv(tables / "replay_agreement.csv")
    assert set(agree["model"]) == set(study["models"]) and (agree["final_scale_exact"] == 1).all()
    assert "fp16-static128" in (tables / "replay_agreement.md").read_text()
    assert (tables / "compare_fp16-static128_vs_fp32.md").read_text().startswith("| fp16-static128 − fp32 |")
    table = pd.read_csv(repo_copy / "results" / "tables" / "summary.csv")
    assert set(zip(table["model"], table["mode"])) == {(m, mode) for m in study["models"] for mode in study["modes"]}
    assert (repo_copy / "results" / "tables" / "summary.md").read_text().startswith("| model | mode |")
    log = repo_copy / "results" / "logs" / "train" / "vit" / "fp32" / "seeds0.log"
    assert "val top-1" in log.read_text()  # one log per job, holding the run's progress
    # and the run folder's own log (every attempt's lines), and the job's record of its run
    assert "val top-1" in (repo_copy / "results" / "runs" / "vit" / "fp32" / "seed0" / "train.log").read_text()
    record = json.loads((repo_copy / "results" / "runs" / "vit" / "fp32" / "seeds0.json").read_text())
    assert [(r["seed"], r["status"]) for r in record["runs"]] == [(0, "ok")]
    check_figures_and_report(repo_copy, study)  # the figures, TensorBoard, summary.html and `snakemake --report`
    # nothing to do when nothing changed
    assert "Nothing to be done" in snakemake(repo_copy, "-n").stdout

    # README "Add a scaling policy": the policy file, and one mode line appended to the config
    blocks = readme_blocks()
    policy_code = next(code for lang, code in blocks if lang == "python")
    mode_line = next(code for lang, code in blocks if lang == "yaml")
    target = policy_code.splitlines()[0].lstrip("# ").strip()
    assert target.startswith("lab/policies/")
    before = {p: p.stat().st_mtime_ns for p in (repo_copy / "results" / "runs").rglob("metrics.json")}
    (repo_copy / target).write_text(policy_code)
    with open(config, "a") as f:
        f.write(mode_line)
    new_mode = yaml.safe_load(mode_line)
    (mode_name,) = new_mode
    second = snakemake(repo_copy, "--cores", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    after = {p: p.stat().st_mtime_ns for p in (repo_copy / "results" / "runs").rglob("metrics.json")}
    assert all(after[p] == t for p, t in before.items()), "existing runs must not be re-trained"
    new_runs = sorted(p.parent.relative_to(repo_copy / "results" / "runs").as_posix() for p in set(after) - set(before))
    assert new_runs == sorted(f"{m}/{mode_name}/seed0" for m in study["models"])
    table = pd.read_csv(repo_copy / "results" / "tables" / "summary.csv")
    assert (table["mode"] == mode_name).sum() == len(study["models"])
    assert len(before) == len(study["modes"]) * len(study["models"])
    assert set(table.loc[table["mode"] == mode_name, "scaler"]) == {new_mode[mode_name]["scaler"]["policy"]}

    # changing one mode re-runs exactly that mode's jobs (and the aggregation)
    edited = yaml.safe_load(config.read_text())
    edited["modes"]["fp16-static128"]["scaler"]["scale"] = 64
    config.write_text(yaml.safe_dump(edited, sort_keys=False))
    dry = snakemake(repo_copy, "-n")
    assert dry.returncode == 0, dry.stderr[-2000:]
    counts = {line.split()[0]: int(line.split()[1]) for line in dry.stdout.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts.get("train") == len(study["models"]) * len(study["seeds"]), dry.stdout
    assert "fp16-static128" in dry.stdout and "mode=fp32" not in dry.stdout and f"mode={mode_name}" not in dry.stdout


def test_bad_config_fails_before_any_job(repo_copy):
    study = tiny_study()
    study["modes"]["fp32"]["precision"] = "fp64"
    (repo_copy / "configs" / "bad.yaml").write_text(yaml.safe_dump(study))
    res = snakemake(repo_copy, "--cores", "1", "--configfile", "configs/bad.yaml")
    assert res.returncode != 0
    assert "modes.fp32.precision" in res.stderr and "fp32, fp16, bf16" in res.stderr
    assert not (repo_copy / "results").exists()


def test_lint_is_clean(repo_copy):
    res = snakemake(repo_copy, "--lint")
    assert res.returncode == 0, res.stdout + res.stderr

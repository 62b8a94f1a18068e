"""A tiny end-to-end Snakemake run in a temporary copy of the repository, and docs/policies.md's example of adding a
scaling policy done exactly as written on it."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from conftest import REPO, tiny_study
from lab.report.notebooks import CONTROLLERS_NOTEBOOK, RECIPES_NOTEBOOK
from test_figures import check_figures_and_report

BIN = Path(sys.executable).parent


def snakemake(cwd, *args, timeout=600):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def readme_blocks():
    """The policy file and the mode line of docs/policies.md's example (README's "Add a scaling policy" links it)."""
    text = (REPO / "docs" / "policies.md").read_text()
    section = text.split("### Example: bounded, one file and one line", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_study_end_to_end_a_new_policy_as_the_readme_says_and_selective_rerun(repo_copy):
    """The README's commands on a tiny study standing in for configs/default.yaml (modes last, as in the shipped
    file): `snakemake --cores 2` writes every table, figure and the report; then docs/policies.md's two steps of "Add a
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
    # every training job was forked from the study's warm job server (lab/run/warm.py), which stopped at the end
    served = (repo_copy / "results" / "logs" / "job_server.log").read_text()
    assert served.count("job server: job ") == len(study["models"]) * len(study["modes"]), served
    assert "--model vit --mode fp32" in served
    check_figures_and_report(repo_copy, study)  # the figures, TensorBoard, summary.html and `snakemake --report`
    # nothing to do when nothing changed
    assert "Nothing to be done" in snakemake(repo_copy, "-n").stdout

    # "Add a scaling policy" (docs/policies.md's example): the policy file, and one mode line appended to the config
    blocks = readme_blocks()
    policy_code = next(code for lang, code in blocks if lang == "python")
    mode_line = next(code for lang, code in blocks if lang == "yaml")
    target = policy_code.splitlines()[0].lstrip("# ").strip()
    assert target.startswith("lab/scaling/policies/")
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


def test_a_study_moved_by_results_dir_fine_tunes_its_base_there(repo_copy, tmp_path):
    """`--config results_dir=DIR`, an override no config file holds, moves the whole study: the base model trains
    into DIR and its fine-tune loads the weights from there (every job reads the study as the workflow resolved
    it, DIR/study.yaml); afterwards nothing is left to run. configs/finetune.yaml shrunk to one run each."""
    study = yaml.safe_load((REPO / "configs" / "finetune.yaml").read_text())
    study.update(device="cpu", seeds=[0], seeds_per_job=1, results_dir="results/not-here")
    study["train"].update(max_steps=2, batch_size=8, log_every=1, census_every=0)
    study["models"]["lm_base"]["train"] = {"max_steps": 2}
    study["models"]["lm_lora"]["modes"] = ["fp32"]
    (repo_copy / "configs" / "tiny_finetune.yaml").write_text(yaml.safe_dump(study))
    moved = tmp_path / "moved"
    # the fine-tune's job record as the target (not the whole study); before --config, which takes the rest
    args = (f"{moved}/runs/lm_lora/fp32/seeds0.json", "--configfile", "configs/tiny_finetune.yaml",
            "--config", f"results_dir={moved}")
    res = snakemake(repo_copy, "--cores", "2", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    base = json.loads((moved / "runs" / "lm_base" / "fp32" / "seed0" / "metrics.json").read_text())
    tuned = json.loads((moved / "runs" / "lm_lora" / "fp32" / "seed0" / "metrics.json").read_text())
    assert tuned["status"] == "ok" and tuned["base_model"]["weights_sha256"] == base["weights_sha256"]
    assert not (repo_copy / "results").exists()  # nothing went to the config file's results_dir
    dry = snakemake(repo_copy, "-n", *args)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout, dry.stdout + dry.stderr[-2000:]
    # a change to the fine-tune alone re-runs its job alone (its --expect-hash), not the base's
    study["models"]["lm_lora"]["finetune"]["rank"] = 4
    (repo_copy / "configs" / "tiny_finetune.yaml").write_text(yaml.safe_dump(study))
    dry = snakemake(repo_copy, "-n", *args)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert re.findall(r"wildcards: model=(\w+), mode=fp32", dry.stdout) == ["lm_lora"], dry.stdout
    # only a study that runs (and holds the folder's lock) writes what the jobs read: a dry run leaves it
    assert yaml.safe_load((moved / "study.yaml").read_text())["models"]["lm_lora"]["finetune"]["rank"] == 8


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


def test_the_study_executes_the_notebooks_in_one_job_after_everything_they_read(repo_copy, tmp_path):
    """`rule all` asks for every notebook executed, RESULTS/notebooks/NAME.ipynb and NAME.html: one job whose
    inputs are the notebooks and what they read (the summary table, every training job's record: it runs once
    they are written, and again when they change), pointed at the study's results folder, here one moved by
    --config results_dir. A dry run: tests/test_notebooks.py executes the notebooks with the same command."""
    shutil.copytree(REPO / "notebooks", repo_copy / "notebooks")
    moved = tmp_path / "moved"
    dry = snakemake(repo_copy, "-n", "-p", "--config", f"results_dir={moved}")
    assert dry.returncode == 0, dry.stderr[-2000:]
    jobs = re.findall(r"^rule (\w+):\n(.*?)\n\n", dry.stdout, flags=re.S | re.M)
    (job,) = [body for rule, body in jobs if rule == "notebooks"]
    fields = dict(re.findall(r"^\s*(input|output|log|Shell command): (.*)$", job, flags=re.M))
    records = {p for rule, body in jobs if rule == "train" for p in re.findall(r"output: (\S+)", body)}
    # the default study executes every notebook but the recipe study's (lab/report/notebooks.py study_notebooks)
    names = sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb") if p.stem not in (RECIPES_NOTEBOOK,
                                                                           CONTROLLERS_NOTEBOOK))
    assert RECIPES_NOTEBOOK in {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}
    assert records and set(fields["input"].split(", ")) == (
        {f"notebooks/{n}.ipynb" for n in names} | {f"{moved}/tables/summary.csv"} | records)
    assert fields["output"].split(", ") == [f"{moved}/notebooks/{n}.{ext}" for n in names for ext in ("ipynb", "html")]
    assert fields["log"] == f"{moved}/logs/notebooks.log"
    assert f"python -m lab notebooks {' '.join(f'notebooks/{n}.ipynb' for n in names)} --results {moved} " \
           f"--out {moved}/notebooks" in fields["Shell command"]

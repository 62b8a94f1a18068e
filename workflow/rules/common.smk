# Validate the config once, before any job starts, and derive the run list from it.
import os
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # `import lab` from the repository root

from lab.core.config import ConfigError, policy_source, resolve_run, save_study, validate_study
from lab.core.run_checks import check_study
from lab.core.study import (base_model_folder, base_run_of, encoder_run_of, run_folder, seeds_label, study_runs,
                            train_jobs)

try:
    STUDY = validate_study(config)
    # what `lab train` would refuse in a run (lab/core/run_checks.py: `lab validate` asks the same), before any job
    check_study(STUDY)
except ConfigError as err:
    raise WorkflowError(str(err))

RESULTS = STUDY["results_dir"]
RUNS = study_runs(STUDY)
# The training jobs: each (model, mode)'s seeds, `seeds_per_job` at a time. A job's output is its record,
# runs/MODEL/MODE/seedsS.json (S: the seeds, e.g. 0-1), written once every seed in it has trained; the rules
# after it read the run folders of RUNS.
def job_record(model, mode, seeds):
    return f"{RESULTS}/runs/{model}/{mode}/seeds{seeds_label(seeds)}.json"


def run_dir(model, mode, seed):
    return str(run_folder(STUDY, model, mode, seed))


TRAIN_JOBS = train_jobs(STUDY)
TRAIN_RECORDS = [job_record(m, mode, seeds) for m, mode, seeds in TRAIN_JOBS]
RUN_DIRS = [run_dir(m, mode, s) for m, mode, s in RUNS]
# What every job's `python -m lab train --config ...` reads: the study as validated here, with the command line's
# `--config key=value` overrides, which the config files lack (results_dir=DIR also moves where a fine-tune
# finds its base model). The Snakefile's onstart writes it, when it changed, once this study holds the folder's
# lock: a dry run, or a second study refused by the lock, never rewrites it under a running one. Not an input:
# each job's --expect-hash decides what re-runs.
STUDY_FILE = f"{RESULTS}/study.yaml"
SUMMARY_CSV = f"{RESULTS}/tables/summary.csv"
SUMMARY_MD = f"{RESULTS}/tables/summary.md"
# One row per run (model, mode, seed, val_loss and the other numbers of its metrics.json; lab/study/runs_table.py),
# written with the summary: what a claims file's per-run claims read (configs/claims.yaml's `reads: runs` claims,
# configs/claims_fp8.yaml whole) and the recipe study's tables
RUNS_CSV = f"{RESULTS}/tables/runs.csv"
# The source study's claims (predicates over summary.csv) and their verdicts: workflow/rules/claims.smk.
CLAIMS_YAML = STUDY["claims_file"]
CLAIMS_MD = f"{RESULTS}/tables/claims.md"
# a study of FP8/FP4 recipes (configs/fp8.yaml): its recipe tables, figure and notebook (workflow/rules/recipes.smk);
# its claims read the per-run table (configs/claims_fp8.yaml: reads: runs)
HAS_RECIPES = any(m.get("recipe") for m in STUDY["modes"].values())
# a study whose runs record their gradients by position (train.position_probe, set for the study, a family or a mode;
# configs/long-context.yaml): its positions table and figure (workflow/rules/positions.smk)
HAS_POSITIONS = any(resolve_run(STUDY, m, mode, s).train.position_probe for m, mode, s in RUNS)

# Training jobs that share one GPU must not run side by side (it would spoil the timings): each declares
# gpu=1, and unless the command line says otherwise only one GPU is available.
if "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", 1)


# Scale models the study fits from its own runs (`controllers:`; workflow/rules/controllers.smk) and the held-out
# runs where the judge replays every scale policy and predictor (`judge:`)
CONTROLLERS = STUDY.get("controllers", {})
MODELS_DIR = f"{RESULTS}/models"
CONTROLLER_FILES = {f"{MODELS_DIR}/{name}.json": name for name in CONTROLLERS}
JUDGE = STUDY.get("judge", {})


def learn_records(name):
    want = CONTROLLERS[name]["learn_from"]
    return [job_record(m, mode, seeds) for m, mode, seeds in TRAIN_JOBS if mode in want.get(m, [])]


def learn_dirs(name):
    want = CONTROLLERS[name]["learn_from"]
    return [run_dir(m, mode, s) for m, mode, s in RUNS if mode in want.get(m, [])]


def judged_dirs(kind):
    want = JUDGE.get(kind, {})
    return [run_dir(m, mode, s) for m, mode, s in RUNS if mode in want.get(m, [])]


def scale_models(wildcards):
    # a mode that names a fitted model (a predictor's or the controller's `model:`) trains after its fit
    text = str(STUDY["modes"][wildcards.mode])
    return [path for path in CONTROLLER_FILES if path in text]


def job_seeds(wildcards):
    return [int(s) for s in wildcards.seeds.split("-")]


def job_runs(wildcards):
    return [resolve_run(STUDY, wildcards.model, wildcards.mode, s) for s in job_seeds(wildcards)]


def expect_hash_args(wildcards):
    # A params value: when a run's resolved config changes, Snakemake re-runs the job that trains it.
    return " ".join(f"--expect-hash {run.hash()}" for run in job_runs(wildcards))


def base_model_record(wildcards):
    # A fine-tuning family (models.X.finetune) loads its base run's weights: the job that trains that run first.
    folder = base_model_folder(STUDY, wildcards.model)
    if folder is not None:  # a local Hugging Face folder: its config.json
        return [str(Path(folder).expanduser() / "config.json")]
    # A vision-language family (models.X.encoder) takes its encoder from another run: that job first too.
    return [job_record(m, md, seeds) for family, mode, seed in filter(None, [base_run_of(STUDY, wildcards.model),
                                                                            encoder_run_of(STUDY, wildcards.model)])
            for m, md, seeds in TRAIN_JOBS if (m, md) == (family, mode) and seed in seeds]


def user_policy_file(wildcards):
    # A mode whose policy lives in a user's file re-runs when that file changes.
    return policy_source(STUDY["modes"][wildcards.mode])


def uses_gpu(wildcards):
    # With a cluster executor (workflow/profiles/slurm) or in a dry run, `device: cuda` asks for a GPU even when
    # this host has none: the GPUs are on the compute nodes, not on the login node. A local run checks this
    # host (an error before any job starts when it has no CUDA); `auto` always asks this host.
    plugin = workflow.executor_plugin
    if STUDY["device"] == "cuda" and (plugin is None or plugin.common_settings.non_local_exec
                                      or plugin.common_settings.dryrun_exec):
        return 1
    from lab.run.process import resolve_device

    return int(resolve_device(STUDY["device"]).startswith("cuda"))


# Training jobs forked from one warm process instead of each importing torch and timm (~5 s a job on 2 cores;
# lab/run/warm.py): local runs only (a cluster's jobs run on other hosts) and one process per run (torchrun starts its
# own ranks). The server stops with the workflow.
JOB_SERVER = {}


def start_job_server():
    plugin = workflow.executor_plugin
    if (plugin is not None and plugin.common_settings.non_local_exec) or STUDY["processes_per_run"] != 1:
        return
    from lab.run.jobs import start_method
    from lab.run.warm import ENV, start_server

    if start_method([STUDY["device"]]) == "spawn":  # CUDA does not survive a fork: a GPU study's jobs start as
        return  # processes of their own, their seeds in fresh interpreters (lab/run/jobs.py)

    Path(f"{RESULTS}/logs").mkdir(parents=True, exist_ok=True)
    JOB_SERVER["proc"], os.environ[ENV] = start_server(os.getcwd(), f"{RESULTS}/logs/job_server.log")


def stop_job_server():
    proc = JOB_SERVER.pop("proc", None)
    if proc is not None:
        proc.terminate()
        proc.wait()

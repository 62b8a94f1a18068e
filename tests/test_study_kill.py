"""A study killed with kill -9 mid-way finishes with the same command, with the tables of an uninterrupted one.

The lab's workflow profile (profiles/default) makes Snakemake re-run the jobs that were running, and each
resumes from its checkpoint; lab/core/lock.py refuses a second snakemake in the folder while one runs.
"""
import filecmp
import os
import shutil
import signal
import subprocess
import time

import pandas as pd
import yaml

from conftest import tiny_study
from test_workflow import BIN

TARGET = "results/tables/summary.csv"
# what must match; timing, throughput and memory columns differ between any two runs
TIMING = ("throughput", "speedup", "memory", "activation", "peak")


def study() -> dict:
    s = tiny_study()
    s["models"] = {"vit": {"preset": "vit-tiny-digits"}}
    s["modes"] = {"fp32": {"precision": "fp32"}, "fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}}
    s["train"].update(epochs=2, max_steps=30, log_every=5, census_every=10, checkpoint_every=3)
    return s


def command(cwd):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    args = [str(BIN / "snakemake"), TARGET, "--cores", "2", "--configfile", "configs/kill.yaml"]
    return dict(args=args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def checkpoints(root):
    return sorted((root / "results" / "runs").rglob("checkpoint/*.pt"))


def trainer_holds(lock) -> bool:
    import fcntl
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_kill_9_mid_study_then_the_same_command_finishes_it_identically(repo_copy, tmp_path):
    (repo_copy / "configs" / "kill.yaml").write_text(yaml.safe_dump(study()))
    reference = tmp_path / "reference"
    shutil.copytree(repo_copy, reference)

    whole = subprocess.Popen(**command(reference))  # the uninterrupted study, side by side (another folder)
    first = subprocess.Popen(**command(repo_copy), start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not checkpoints(repo_copy) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert checkpoints(repo_copy), "no run wrote a checkpoint before the study ended"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # Snakemake and every job it started, as kill -9 of the group
        first.wait()
    assert not list((repo_copy / "results" / "runs").rglob("metrics.json")), "killed too late: a run had finished"
    left = checkpoints(repo_copy)

    # while another process holds the study lock, the command is refused before any job starts
    holder = subprocess.Popen([str(BIN / "python"), "-c", "import time; from lab.core import lock; "
                               "lock.hold(); print('held', flush=True); time.sleep(300)"],
                              cwd=repo_copy, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = subprocess.run(**command(repo_copy), timeout=120)
        assert refused.returncode != 0 and f"another snakemake (pid {holder.pid})" in refused.stdout, \
            refused.stdout[-2000:]
        assert checkpoints(repo_copy) == left and "resuming" not in refused.stdout
    finally:
        holder.kill()
        holder.wait()

    again = subprocess.run(**command(repo_copy), timeout=300)  # the same command, no --unlock, no extra flag
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resuming from" in again.stdout
    assert not checkpoints(repo_copy)  # finished runs delete theirs

    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]
    a, b = (pd.read_csv(root / TARGET) for root in (repo_copy, reference))
    same = [c for c in a.columns if not any(k in c for k in TIMING)]
    pd.testing.assert_frame_equal(a[same], b[same])
    for mode in ("fp32", "fp16-dynamic"):
        run = f"results/runs/vit/{mode}/seed0"
        for name in ("steps.csv", "census.csv"):
            assert filecmp.cmp(repo_copy / run / name, reference / run / name, shallow=False), (mode, name)


def test_a_run_that_finished_after_snakemake_died_is_restored_not_trained_again(repo_copy, tmp_path):
    """Snakemake records a job only after its process exits. Kill Snakemake alone while a run trains: the run
    goes on and finishes, unrecorded. The same command then re-runs the job, which restores the run from the
    copy it kept (lab/run/finished.py) instead of training from step 0; the workflow drops the copy at its end."""
    s = study()
    s["modes"] = {"fp16-dynamic": s["modes"]["fp16-dynamic"]}
    (repo_copy / "configs" / "kill.yaml").write_text(yaml.safe_dump(s))
    run = repo_copy / "results" / "runs" / "vit" / "fp16-dynamic" / "seed0"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(**{**command(repo_copy), "stdout": log})
        deadline = time.monotonic() + 240
        while not checkpoints(repo_copy) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert checkpoints(repo_copy), "the run wrote no checkpoint before the study ended"
        first.kill()  # Snakemake only: its job goes on
        first.wait()
    deadline = time.monotonic() + 240
    while (run / "checkpoint").exists() and time.monotonic() < deadline:  # removed once the run is complete
        time.sleep(0.1)
    while trainer_holds(run / ".lock") and time.monotonic() < deadline:  # the orphaned trainer has exited
        time.sleep(0.1)
    assert (run / "metrics.json").is_file() and (run / ".finished" / "metrics.json").is_file()
    files = ("metrics.json", "steps.csv", "census.csv", "grad_hist.csv", "provenance.json", "config.yaml")
    before = {name: (run / name).read_bytes() for name in files}

    again = subprocess.run(**command(repo_copy), timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "restored from" in again.stdout and "step 5/30" not in again.stdout, again.stdout[-3000:]
    assert {name: (run / name).read_bytes() for name in files} == before  # the same run, timings included
    assert not (run / ".finished").exists(), "the workflow's end should drop the copy"
    # the rule's log holds this attempt; the run's train.log every attempt (the one that trained to the end)
    rule_log = (repo_copy / "results" / "logs" / "train" / "vit" / "fp16-dynamic" / "seeds0.log").read_text()
    attempts = (run / "train.log").read_text()
    assert "restored from" in rule_log and "step 30/30" not in rule_log
    assert "step 30/30" in attempts and attempts.index("step 30/30") < attempts.index("restored from")

"""A workflow job of several seeds (lab/run/jobs.py, `seeds_per_job`): each seed forked from one warm process,
its files equal to the seed trained alone; failures and signals stop the job; the run folder's own log."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO, tiny_study
from lab import cli
from lab.core.config import validate_study
from lab.core.study import train_jobs
from lab.run import jobs
# imported here, at collection, not first by lab_here inside a redirect: train()'s default progress stream is the
# sys.stderr of its first import
from lab.run import train as _train  # noqa: F401

# what differs between any two runs of the same config: timings, throughput, memory, the time of day
TIMING = ("time", "wall", "throughput", "samples_per_s", "memory", "mem", "started", "finished", "peak")


def study_file(tmp_path, steps=6, **train) -> Path:
    s = tiny_study()
    s["models"] = {"vit": {"preset": "vit-tiny-digits"}}
    s["modes"] = {"dyn": {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0 ** 20,
                                                           "growth_interval": 2}}}
    s["train"].update(max_steps=steps, census_every=2, log_every=1, **train)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(s))
    return path


def lab(*args, **kw):
    return subprocess.run([sys.executable, "-m", "lab", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, **kw)


def lab_here(*args) -> tuple[int, str]:
    """`python -m lab ARGS` in this process (lab.cli.main, what lab/__main__.py calls), where a process of its own
    is not what a test is about (a subprocess cost ~4 s of importing torch): exit status, stderr."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, err.getvalue()


def train_args(config, out, *seeds):
    return ["train", "--model", "vit", "--mode", "dyn", *[a for s in seeds for a in ("--seed", s)], "--out", out,
            "--config", config]


def same_run(a: Path, b: Path):
    for name in ("steps.csv", "census.csv", "grad_hist.csv"):
        x, y = pd.read_csv(a / name), pd.read_csv(b / name)
        cols = [c for c in x.columns if not any(k in c for k in TIMING)]
        pd.testing.assert_frame_equal(x[cols], y[cols], obj=name)
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    keys = [k for k in ma if not any(t in k for t in TIMING)]
    assert {k: ma[k] for k in keys} == {k: mb.get(k) for k in keys}
    assert yaml.safe_load((a / "config.yaml").read_text()) == yaml.safe_load((b / "config.yaml").read_text())


def test_a_job_of_several_seeds_equals_each_seed_alone_and_resumes_after_sigterm(tmp_path):
    """SIGTERM to the job: the seed training checkpoints and stops (143), the job trains no further seed and
    writes no record. The same command then resumes that seed and trains the next, which equals that seed trained
    alone by `lab train`; the record names both, and each run folder's log holds its own run's lines, both
    attempts of the first."""
    config = study_file(tmp_path, steps=12, checkpoint_every=1)
    job = train_args(config, tmp_path / "job" / "seed{seed}", 0, 1) + [
        "--run-log", "--done", tmp_path / "job" / "seeds0-1.json"]
    first = subprocess.Popen([sys.executable, "-m", "lab", *map(str, job)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    checkpoints = tmp_path / "job" / "seed0" / "checkpoint"
    deadline = time.monotonic() + 240
    while not (checkpoints.is_dir() and any(checkpoints.glob("*.pt"))) and time.monotonic() < deadline \
            and first.poll() is None:
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # to the job, not to the child that trains
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 143, out[-3000:]
    assert "signal SIGTERM: checkpoint written" in out
    assert not (tmp_path / "job" / "seed0" / "metrics.json").exists() and any(checkpoints.glob("*.pt"))
    assert not (tmp_path / "job" / "seed1").exists() and not (tmp_path / "job" / "seeds0-1.json").exists()

    again = lab(*job)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "resuming from" in out and "vit/dyn/seed0: status ok" in out and "vit/dyn/seed1: status ok" in out
    # the seed forked after the first equals it trained alone (exact resume: tests/test_resume.py)
    rc, err = lab_here(*train_args(config, tmp_path / "alone1", 1))
    assert rc == 0, err[-3000:]
    same_run(tmp_path / "job" / "seed1", tmp_path / "alone1")
    hashes = [json.loads((tmp_path / "job" / f"seed{s}" / "metrics.json").read_text())["config_hash"] for s in (0, 1)]
    assert hashes[1] == json.loads((tmp_path / "alone1" / "metrics.json").read_text())["config_hash"]
    assert len(set(hashes)) == 2
    record = json.loads((tmp_path / "job" / "seeds0-1.json").read_text())
    assert [(r["seed"], r["status"], r["config_hash"], Path(r["run_dir"]).name) for r in record["runs"]] == \
        [(0, "ok", hashes[0], "seed0"), (1, "ok", hashes[1], "seed1")]
    logs = [(tmp_path / "job" / f"seed{s}" / "train.log").read_text() for s in (0, 1)]
    assert "signal SIGTERM" in logs[0] and "resuming from" in logs[0] and "seed1" not in logs[0]
    assert "[vit/dyn/seed1]" in logs[1] and "seed0" not in logs[1]


def test_forked_children_report_their_status_and_stop_the_job(tmp_path):
    def train_one(item):
        (tmp_path / f"ran{item}").write_text(str(os.getpid()))
        if item == "fails":
            return 3
        if item == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if item == "raises":
            raise RuntimeError("boom")
        return 0

    assert jobs.run_each(["a", "b"], train_one) == 0
    pids = {(tmp_path / f"ran{x}").read_text() for x in ("a", "b")}
    assert len(pids) == 2 and str(os.getpid()) not in pids  # each in its own child, none in this process
    assert jobs.run_each(["c", "fails", "d"], train_one) == 3 and not (tmp_path / "rand").exists()
    assert jobs.run_each(["killed", "e"], train_one) == 128 + signal.SIGKILL and not (tmp_path / "rane").exists()
    assert jobs.run_each(["raises", "f"], train_one) == 1 and not (tmp_path / "ranf").exists()


def test_runs_that_may_use_cuda_start_in_fresh_interpreters(monkeypatch):
    """CUDA does not survive a fork (torch marks the children of a process that asked for the device count unable to
    initialise it): a job whose runs may use CUDA spawns them, decided from torch's build, never from the driver."""
    import torch

    def driver(*a):
        raise AssertionError("start_method called the CUDA driver")
    monkeypatch.setattr(torch.cuda, "is_available", driver)
    monkeypatch.setattr(torch.cuda, "device_count", driver)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", driver, raising=False)
    monkeypatch.delenv(jobs.START_ENV, raising=False)
    for built in (False, True):
        monkeypatch.setattr(torch.cuda, "_is_compiled", lambda built=built: built)
        assert jobs.start_method(["cpu", "cpu"]) == "fork"
        assert jobs.start_method(["cpu", "cuda"]) == jobs.start_method(["cuda:1"]) == "spawn"
        assert jobs.start_method(["auto"]) == ("spawn" if built else "fork")
    monkeypatch.setenv(jobs.START_ENV, "spawn")
    assert jobs.start_method(["cpu"]) == "spawn"
    monkeypatch.setenv(jobs.START_ENV, "vfork")
    with pytest.raises(ValueError, match="fork or spawn"):
        jobs.start_method(["cpu"])


def test_spawned_children_report_their_status_and_stop_the_job(tmp_path):
    """run_each's spawn: each item unpickled and run in an interpreter of its own; the first failure stops the job."""
    def item(name, then="exit 0"):  # subprocess.call(item): a shell whose parent is the spawned interpreter
        return ["sh", "-c", f"echo $PPID > {tmp_path / name}; tr '\\0' ' ' < /proc/$PPID/cmdline >> {tmp_path / name}; "
                f"{then}"]
    assert jobs.run_each([item("a"), item("b")], subprocess.call, "spawn") == 0
    children = [(tmp_path / x).read_text().split("\n", 1) for x in ("a", "b")]
    assert len({pid for pid, _ in children}) == 2 and str(os.getpid()) not in {pid for pid, _ in children}
    assert all("from lab.run.jobs import spawned" in cmdline for _, cmdline in children)  # a fresh interpreter
    assert jobs.run_each([item("c", "exit 3"), item("d")], subprocess.call, "spawn") == 3
    assert not (tmp_path / "d").exists()
    assert jobs.run_each([item("e", "kill -9 $PPID"), item("f")], subprocess.call, "spawn") == 128 + signal.SIGKILL
    assert not (tmp_path / "f").exists()


def test_a_spawned_job_trains_each_seed_as_it_trains_alone(tmp_path, monkeypatch):
    """The way a GPU job starts its seeds, on the CPU (LAB_JOB_START=spawn): the second seed's files equal that seed
    trained alone."""
    config = study_file(tmp_path)
    monkeypatch.setenv(jobs.START_ENV, "spawn")
    rc, err = lab_here(*train_args(config, tmp_path / "job" / "seed{seed}", 0, 1))
    assert rc == 0, err[-3000:]
    monkeypatch.delenv(jobs.START_ENV)
    rc, err = lab_here(*train_args(config, tmp_path / "alone1", 1))
    assert rc == 0, err[-3000:]
    same_run(tmp_path / "job" / "seed1", tmp_path / "alone1")
    assert (tmp_path / "job" / "seed0" / "metrics.json").exists()


def test_a_cpu_run_never_initialises_cuda_for_its_checkpoint(monkeypatch):
    """A checkpoint keeps CUDA's generators only where the run initialised CUDA: a CPU run on a GPU machine (forked
    from a job) must not initialise it there (a forked child cannot)."""
    import torch
    from lab.run import checkpoint

    def initialises():
        raise AssertionError("the checkpoint initialised CUDA")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", initialises)
    assert "cuda" not in checkpoint.rng_state()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(4, dtype=torch.uint8)])
    assert checkpoint.rng_state()["cuda"][0].shape == (4,)


def test_nccl_starts_bound_to_the_ranks_gpu(monkeypatch):
    """The NCCL process group is created with device_id (this rank's GPU), not left to guess it."""
    import torch
    from lab.run import distributed
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.update(set_device=i))
    d = distributed.from_env("cuda")
    assert d.local_rank == 1 and calls == {"backend": "nccl", "device_id": torch.device("cuda", 1), "set_device": 1}
    calls.clear()
    distributed.from_env("cpu")
    assert calls == {"backend": "gloo"}


def hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the lab's lock at `path` (lab/core/lock.py) until killed; returns once it holds it."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lab.core import lock; "
                               "lock.hold(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(path)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_trainer_on_a_locked_run_directory_exits_2_naming_the_pid(tmp_path):
    study = tiny_study()
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = hold_lock(run_dir / ".lock")
    try:
        rc, err = lab_here("train", "--config", tmp_path / "study.yaml", "--model", "vit", "--mode", "fp32", "--seed",
                           "0", "--out", run_dir)
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2, err[-2000:]
    assert f"another process (pid {holder.pid}) is training {run_dir}" in err
    assert not (run_dir / "metrics.json").exists()


def test_the_run_log_takes_python_and_c_level_output(tmp_path):
    code = ("import os, sys\nfrom lab.run.jobs import run_log\n"
            f"with run_log({str(tmp_path / 'run')!r}):\n"
            "    print('from python')\n    print('to stderr', file=sys.stderr)\n    os.write(2, b'from C\\n')\n"
            "print('after')\n")
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == "from python to stderr from C after".split()
    log = (tmp_path / "run" / "train.log").read_text()
    assert log == "from python\nto stderr\nfrom C\n" * 2  # appended, attempt after attempt; "after" is not in it


@pytest.mark.parametrize("args,message", [
    (["--seed", "0", "--seed", "1", "--out", "somewhere"], "expected a path holding {seed}"),
    (["--seed", "0", "--seed", "0", "--out", "x{seed}"], "expected each seed once"),
    (["--seed", "0", "--seed", "1", "--out", "x{seed}", "--expect-hash", "abc"], "expected one per seed (2)"),
])
def test_bad_job_arguments_are_refused_before_anything_is_written(tmp_path, args, message):
    rc, err = lab_here("train", "--model", "vit", "--mode", "dyn", "--config", study_file(tmp_path),
                       *[a.replace("x{seed}", str(tmp_path / "x{seed}")) for a in args])
    assert rc == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


def test_train_jobs_chunk_each_mode_seeds_and_torchrun_jobs_train_one_run():
    s = tiny_study(seeds=[0, 1, 2], seeds_per_job=2)
    s["models"]["lm"] = {"preset": "gpt-tiny", "seeds": [5], "data": {"name": "pydoc"}}
    study = validate_study(s)
    assert train_jobs(study) == [(m, mode, seeds) for m, seeds_list in
                                 (("resnet50", [(0, 1), (2,)]), ("vit", [(0, 1), (2,)]), ("lm", [(5,)]))
                                 for mode in s["modes"] for seeds in seeds_list]
    study["processes_per_run"] = 2
    assert {seeds for _, _, seeds in train_jobs(study)} == {(0,), (1,), (2,), (5,)}
    study["processes_per_run"] = 1  # a family that trains some of the modes only: jobs for those alone
    study["models"]["lm"]["modes"] = [list(s["modes"])[0]]
    assert [(m, mode) for m, mode, _ in train_jobs(study) if m == "lm"] == [("lm", list(s["modes"])[0])]

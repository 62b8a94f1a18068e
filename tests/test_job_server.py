"""The study's warm job server (lab/run/warm.py): a training command run in a child of the server behaves as the
command in its own process does: its folder, its streams, its exit status, a signal that checkpoints, a resume."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_jobs import study_file, train_args


@pytest.fixture
def server(tmp_path):
    folder = tmp_path / "srv"
    folder.mkdir()
    path, log = folder / "socket", folder / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lab", "job-server", "--socket", str(path)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "ready" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ready" in log.read_text(), log.read_text()
    yield path, log
    proc.terminate()
    proc.wait(timeout=30)
    assert not path.exists()  # a stopped server leaves no socket behind


def command(path, *args, **kw):
    env = dict(os.environ, LAB_JOB_SERVER=str(path), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "lab", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_a_job_on_the_server_checkpoints_on_sigterm_resumes_and_exits_as_a_plain_job(server, tmp_path):
    path, log = server
    config = study_file(tmp_path, steps=12, checkpoint_every=1)
    work = tmp_path / "work"  # the command's own folder: its relative --out lands there, not in the server's
    work.mkdir()
    job = train_args(config, "job/seed{seed}", 0, 1) + ["--done", "job/seeds0-1.json"]
    first = command(path, *job, cwd=work)
    checkpoints = work / "job" / "seed0" / "checkpoint"
    deadline = time.monotonic() + 240
    while not (checkpoints.is_dir() and any(checkpoints.glob("*.pt"))) and time.monotonic() < deadline \
            and first.poll() is None:
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # to the command: the server's child must get it
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 143, out[-3000:]
    assert "signal SIGTERM: checkpoint written" in out  # the child's output came through the command's streams
    assert not (work / "job" / "seeds0-1.json").exists()

    again = command(path, *job, cwd=work)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert "resuming from" in out and "vit/dyn/seed1: status ok" in out
    assert (work / "job" / "seeds0-1.json").exists()
    served = [line for line in log.read_text().splitlines() if line.startswith("job server: job ")]
    assert len(served) == 2 and all("lab train --model vit" in line for line in served)  # not run in-process

    bad = command(path, "train", "--model", "nope", "--mode", "dyn", "--out", "x", "--config", config, cwd=work)
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 2 and "error: --model" in out


def test_without_a_server_the_command_runs_in_its_own_process(tmp_path):
    config = study_file(tmp_path, steps=2)
    plain = command(tmp_path / "no-such-socket", *train_args(config, tmp_path / "run", 0), cwd=REPO)
    out, _ = plain.communicate(timeout=300)
    assert plain.returncode == 0, out[-3000:]
    assert (tmp_path / "run" / "metrics.json").exists()

"""What the lab trusts (docs/reliability.md): files in a run directory or a data folder carry no code that runs.

A checkpoint loads with torch.load(weights_only=True): one whose unpickling would run code (planted where
`python -m lab train` resumes) is refused with exit status 2 and one line naming the file and the type, the
code never runs and the run directory is left as it was; every checkpoint the lab writes loads that way. A
CIFAR-10 batch file is unpickled with only the types a batch holds (lab/data/safe_pickle.py)."""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from lab.data.datasets import DataError, load_data
from lab.run import checkpoint

from conftest import REPO, tiny_study
from test_resume import drive, study


class Planted:
    """Unpickling it writes ``marker``: what a malicious checkpoint or batch file would do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("writer,says", [("torch.save", "needs posix.system"),  # the zip format the lab writes
                                         ("pickle", "cannot be read")])  # a bare pickle: torch's legacy format
def test_planted_checkpoint_is_refused_and_never_runs(tmp_path, writer, says):
    marker, run_dir = tmp_path / "marker", tmp_path / "run"
    planted = checkpoint.folder(run_dir) / "step00000001.pt"
    planted.parent.mkdir(parents=True)
    payload = {"config_hash": "x", "step": 1, "model": Planted(marker)}
    if writer == "torch.save":
        torch.save(payload, planted)
    else:
        planted.write_bytes(pickle.dumps(payload))
    before = snapshot(run_dir)
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(tiny_study()))
    done = subprocess.run([sys.executable, "-m", "lab", "train", "--model", "resnet50", "--mode", "fp32", "--seed",
                           "0", "--out", str(run_dir), "--config", str(config)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert not marker.exists(), "the planted checkpoint's code ran"
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(planted) in lines[0] and says in lines[0], done.stderr
    assert "weights_only=False" not in lines[0]  # torch's advice to load it anyway is not passed on
    assert snapshot(run_dir) == before, "a refused checkpoint leaves the run directory as it was"


def test_every_checkpoint_the_lab_writes_loads_with_weights_only(tmp_path):
    """A real run stopped by SIGTERM (a scheduler's warning) after several checkpoints; then the same run
    resumed in process and stopped again, so a resumed run's checkpoints are checked too."""
    run_dir = tmp_path / "run"
    spec = {"study": study("dynamic-skips"), "model": "resnet50", "mode": "dynamic-skips", "seed": 0,
            "out": str(run_dir), "kill": "sigterm:5"}
    done = drive(spec)  # forked from this process (test_resume.drive); the resume below, a process of its own
    assert done.returncode == 143, done.stderr[-2000:]
    path = checkpoint.latest(run_dir)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["step"] > 0 and isinstance(state["rng"]["numpy"][1], torch.Tensor)
    checkpoint.check_plain(state)
    # the same command resumes from that checkpoint and is stopped again: the resumed run's checkpoint loads too
    again = subprocess.run([sys.executable, str(REPO / "tests" / "resume_driver.py"),
                            json.dumps({**spec, "kill": "sigterm:4"})], cwd=REPO,  # 4 micro-batches on
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 143, again.stderr[-2000:]
    assert "resuming from" in again.stdout + again.stderr
    later = torch.load(checkpoint.latest(run_dir), map_location="cpu", weights_only=True)
    assert later["step"] > state["step"]
    checkpoint.check_plain(later)


def test_generator_states_round_trip_exactly():
    import random
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.random(), np.random.standard_normal()  # NumPy keeps a cached Gaussian: it must come back too
    saved = checkpoint.rng_state()
    draws = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    checkpoint.set_rng_state(saved)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == draws


def test_an_entry_weights_only_cannot_load_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint\['scaler'\]\['tracker'\] is a numpy.float64"):
        checkpoint.save(tmp_path, {"step": 1, "scaler": {"tracker": np.float64(1.0)}})
    assert not checkpoint.folder(tmp_path).exists()


# --------------------------------------------------------------- CIFAR-10 batches


def cifar_folder(tmp_path, planted=None):
    """A tiny cifar-10-batches-py folder; ``planted``: data_batch_3 replaced by that object, pickled."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        batch = {b"batch_label": b"x", b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                 b"labels": [0, 1, 2, 3], b"filenames": [b"a.png"] * 4}
        # protocols 2 (the official files' and Python 3's bytes via _codecs), 4 and 5 (NumPy's _frombuffer)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=(2, 4, 5)[i % 3]))
    if planted is not None:
        (folder / "data_batch_3").write_bytes(pickle.dumps(planted, protocol=2))
    return folder


def test_cifar_batches_of_every_pickle_protocol_load(tmp_path):
    assert len(load_data("cifar10", path=str(cifar_folder(tmp_path))).train) == 20


@pytest.mark.parametrize("nested", [False, True])
def test_planted_cifar_batch_is_refused_and_never_runs(tmp_path, nested):
    marker = tmp_path / "marker"
    payload = {b"data": Planted(marker), b"labels": [0]} if nested else Planted(marker)
    folder = cifar_folder(tmp_path, planted=payload)
    with pytest.raises(DataError) as err:
        load_data("cifar10", path=str(folder))
    assert not marker.exists(), "the planted batch's code ran"
    message = str(err.value)
    assert str(folder / "data_batch_3") in message and "system" in message and "\n" not in message, message

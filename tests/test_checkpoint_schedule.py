"""When checkpoints are written and how many are kept (train.checkpoint_every / checkpoint_minutes /
checkpoint_keep, lab/run/loop.py and lab/run/checkpoint.py), on real training runs with a fake clock."""
import pytest

import lab.run.loop as L
from lab.core.config import resolve_run, validate_study
from lab.run import checkpoint
from lab.run.train import train

from conftest import tiny_study

STEPS = 10


def run(tmp_path, monkeypatch, seconds_per_step=0.0, **train_settings):
    """Trains STEPS steps; returns, per checkpoint written, (its step, the step files in the folder after it)."""
    s = tiny_study()
    s["modes"] = {"fp32": {"precision": "fp32"}}
    s["train"].update(max_steps=STEPS, epochs=5, census_every=0, log_every=1, **train_settings)
    cfg = resolve_run(validate_study(s), "resnet50", "fp32", 0)
    clock = {"t": 1000.0}
    forward_backward = L.forward_backward

    def counted(*a, **k):  # the clock moves with training: seconds_per_step per micro-batch
        clock["t"] += seconds_per_step
        return forward_backward(*a, **k)
    monkeypatch.setattr(L, "forward_backward", counted)
    monkeypatch.setattr(L.time, "monotonic", lambda: clock["t"])
    saved = []
    save = checkpoint.save

    def recording_save(run_dir, state, keep=1):
        path = save(run_dir, state, keep)
        saved.append((state["step"], sorted(p.name for p in path.parent.glob("step*.pt"))))
        return path
    monkeypatch.setattr(checkpoint, "save", recording_save)
    metrics = train(cfg, tmp_path / "run")
    assert metrics["steps"] == STEPS
    return saved


def test_checkpoint_every_n_steps_keeps_the_newest(tmp_path, monkeypatch):
    saved = run(tmp_path, monkeypatch, checkpoint_every=3, checkpoint_minutes=0, checkpoint_keep=2)
    assert [s for s, _ in saved] == [3, 6, 9]
    assert [files for _, files in saved] == [["step00000003.pt"], ["step00000003.pt", "step00000006.pt"],
                                             ["step00000006.pt", "step00000009.pt"]]
    assert not checkpoint.folder(tmp_path / "run").exists()  # the finished run removed them


@pytest.mark.parametrize("seconds,expected", [(25.0, [3, 6, 9]), (60.0, list(range(1, STEPS + 1))), (7.0, [9]),
                                              (5.0, [])])
def test_checkpoint_every_n_minutes_by_the_clock(tmp_path, monkeypatch, seconds, expected):
    """checkpoint_minutes: 1 and no step interval: a checkpoint at the first step that ends a minute or more
    after the last one (or the run's start). A step here takes `seconds` of the fake clock."""
    saved = run(tmp_path, monkeypatch, seconds_per_step=seconds, checkpoint_every=0, checkpoint_minutes=1.0)
    assert [s for s, _ in saved] == expected
    assert all(len(files) == 1 for _, files in saved)  # checkpoint_keep 1

"""The peak memory a run reports is its training step's: the census's FP32 replay (which keeps the FP16
step's gradients), overflow-attribution replays, the activation probe, evaluation and checkpoints are measured
apart. A simulated allocator stands in for CUDA's counters: the lab's additions allocate far more than a step, and
the reported peak must not see them."""
from __future__ import annotations

import pytest

from lab.core.config import resolve_run, validate_study
from lab.run import loop as loop_mod, memory, train as train_mod
from lab.run.train import train

from conftest import tiny_study

STEP, EXTRA = 100 * 2**20, 10_000 * 2**20  # bytes: what a step holds, what each addition holds on top


class SimulatedAllocator:
    """max_memory_allocated / reset_peak_memory_stats as CUDA's: a peak since the last reset."""

    def __init__(self):
        self.current = self.peak = STEP

    def hold(self, extra: int):
        self.current += extra
        self.peak = max(self.peak, self.current)

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.current


def _holding(fn, allocator):
    def wrapped(*args, **kwargs):
        allocator.hold(EXTRA)
        try:
            return fn(*args, **kwargs)
        finally:
            allocator.hold(-EXTRA)
    return wrapped


def test_unit_a_window_outside_the_step_keeps_its_own_peak(monkeypatch):
    a = SimulatedAllocator()
    monkeypatch.setattr(memory.StepMemory, "allocator", a)
    step_memory = memory.StepMemory("cpu")
    with step_memory.outside("evaluation"):
        a.hold(EXTRA)
        a.hold(-EXTRA)
    a.hold(5)
    m = step_memory.metrics()
    assert m["peak_memory_mb"] == pytest.approx((STEP + 5) / 2**20)
    assert m["peak_memory_evaluation_mb"] == pytest.approx((STEP + EXTRA) / 2**20)
    assert m["memory_kind"] == "cuda_max_allocated" and "evaluation" in m["peak_memory_covers"]


def test_a_runs_peak_is_its_training_steps_not_the_labs_replays_or_evaluation(tmp_path, monkeypatch):
    a = SimulatedAllocator()
    monkeypatch.setattr(memory.StepMemory, "allocator", a)
    for mod, name in ((loop_mod, "replay_step"), (loop_mod, "evaluate"), (train_mod, "activation_bytes"),
                      (loop_mod, "save_checkpoint")):
        monkeypatch.setattr(mod, name, _holding(getattr(mod, name), a))
    study = tiny_study()
    # an FP16 run that overflows at its first steps (attribution replays) with a census and its FP32 replay
    study["modes"]["dyn"] = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0**40}}
    study["train"].update(max_steps=4, census_every=2, checkpoint_every=2)
    metrics = train(resolve_run(validate_study(study), "resnet50", "dyn", 0), tmp_path / "dyn")
    assert metrics["overflow_steps"] >= 1
    assert metrics["peak_memory_mb"] < EXTRA / 2**20
    for part in ("census_fp32_replay", "attribution_replay", "evaluation", "activation_probe", "checkpoint"):
        assert metrics[f"peak_memory_{part}_mb"] >= EXTRA / 2**20, part
        assert part in metrics["peak_memory_covers"]


def test_on_a_cpu_the_peak_is_the_processs_and_says_so(tmp_path):
    study = tiny_study()
    metrics = train(resolve_run(validate_study(study), "resnet50", "fp32", 0), tmp_path / "fp32")
    assert metrics["memory_kind"] == "cpu_peak_rss" and "whole process" in metrics["peak_memory_covers"]

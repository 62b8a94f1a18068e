"""train.emulated_accum: each backward at the FP16 magnitudes of a D-way accumulated step (lab/run/loop.py), and the
overflow split (initial descent / in training, growth attempts) that every run records."""
import csv
import math

import pytest
import torch

from lab.core.config import resolve_run, validate_study
from lab.run.train import train
import lab.scaling as ls

from conftest import tiny_study

TRAJECTORY = ("loss", "grad_norm", "found_inf", "skipped")


def lm_run(tmp_path, name, mode_def, steps=6, **overrides):
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny",
                              "data": {"name": "pydoc", "context": 16, "vocab_size": 256, "val_fraction": 0.1}}}
    study["modes"] = {"m": mode_def}
    study["train"].update(epochs=1, max_steps=steps, batch_size=16, census_every=0, **overrides)
    cfg = resolve_run(validate_study(study), "lm", "m", 0)
    out = tmp_path / name
    return train(cfg, out), out


def columns(out, names=TRAJECTORY):
    with open(out / "steps.csv") as f:
        return [tuple(row[c] for c in names) for row in csv.DictReader(f)]


def test_fp32_training_is_unchanged_bit_for_bit(tmp_path):
    """Dividing the loss by a power of two before backward and multiplying the gradient back in FP32 is exact."""
    m1, a = lm_run(tmp_path, "d1", {"precision": "fp32"})
    m8, b = lm_run(tmp_path, "d8", {"precision": "fp32"}, emulated_accum=8)
    assert columns(a) == columns(b)
    assert m1["final_val_loss"] == m8["final_val_loss"]
    assert (m1["loss_divisor"], m8["loss_divisor"]) == (1, 8)
    assert m8["regime_tokens_per_step"] == 8 * m8["tokens_per_backward"] == 8 * 16 * 16


def test_fp16_sees_the_scale_divided_by_d(tmp_path):
    """For FP16, emulated_accum D is the same as every scale divided by D: a run without scaling at D = 64 trains
    exactly like a static scale of 1/64 at D = 1 (the same FP16 backward, the same FP32 update)."""
    _, a = lm_run(tmp_path, "emulated", {"precision": "fp16", "scaler": {"policy": "none"}}, emulated_accum=64)
    _, b = lm_run(tmp_path, "scale", {"precision": "fp16", "scaler": {"policy": "static", "scale": 1 / 64}})
    assert columns(a) == columns(b)
    # and it is not the FP16 run at D = 1: the smaller backward loses values to underflow
    _, c = lm_run(tmp_path, "plain", {"precision": "fp16", "scaler": {"policy": "none"}})
    assert columns(c) != columns(a)


def test_the_gradient_the_optimizer_sees_is_the_full_step_gradient(tmp_path):
    """The grad norm logged (after unscaling) is the step's, not 1/D of it: FP32 D = 4 equals D = 1."""
    _, a = lm_run(tmp_path, "d1", {"precision": "fp32"}, steps=2)
    _, b = lm_run(tmp_path, "d4", {"precision": "fp32"}, steps=2, emulated_accum=4)
    assert columns(a, ("grad_norm",)) == columns(b, ("grad_norm",))
    assert float(columns(b, ("grad_norm",))[0][0]) > 0


def drive(scaler, found_infs):
    """Run the scaler over a sequence of steps, planting inf in the gradient where asked."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in found_infs:
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_overflow_split_counts_the_descent_apart_from_training():
    s = ls.create("dynamic", init_scale=2.0 ** 10, growth_interval=2, device="cpu")
    # 3 overflows of the descent, clean, clean (growth), overflow (the probe), clean x2 (growth), overflow
    drive(s, [1, 1, 1, 0, 0, 1, 0, 0, 1])
    assert (s.overflow_steps, s.initial_overflow_steps, s.in_training_overflow_steps) == (5, 3, 2)
    assert s.first_clean_step == 3 and s.growth_steps == 2
    again = ls.create("dynamic", init_scale=2.0 ** 10, growth_interval=2, device="cpu")
    again.load_state_dict(s.state_dict())  # checkpointed with the scaler
    assert (again.initial_overflow_steps, again.first_clean_step, again.growth_steps) == (3, 3, 2)


def test_a_run_that_never_overflows_has_no_descent():
    s = ls.create("dynamic", init_scale=1.0, growth_interval=3, device="cpu")
    drive(s, [0] * 7)
    assert (s.initial_overflow_steps, s.first_clean_step, s.growth_steps) == (0, 0, 2)


@pytest.mark.parametrize("never_clean", [True, False])
def test_run_metrics_carry_the_split(tmp_path, never_clean):
    init = 2.0 ** 100 if never_clean else 2.0 ** 40  # from 2^40 the descent ends within the run
    m, out = lm_run(tmp_path, "r", {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": init}},
                    steps=30)
    skipped = [int(r[0]) for r in columns(out, ("found_inf",))]
    descent = next((i for i, f in enumerate(skipped) if not f), len(skipped))
    assert m["overflow_initial"] == descent
    assert m["overflow_in_training"] == sum(skipped) - descent
    if never_clean:
        assert m["first_clean_step"] is None and m["overflow_per_1k"] is None
    else:
        assert m["first_clean_step"] == descent
        assert m["overflow_per_1k"] == pytest.approx(1000 * m["overflow_in_training"] / (30 - descent))
    assert m["growth_interval"] == 2000

"""`lab replay` (lab/diagnose/replay.py): the replayed rule is the real one, the underflow share is the census's,
and the CLI reads what a run records."""
import csv
import json
import math
import random

import pytest
import torch
import yaml

import lab.scaling
from lab.cli import main
from lab.diagnose.replay import read_run, replay
from lab.numerics.census import census, log2_histogram

F16 = torch.finfo(torch.float16)


def write_run(d, amax, scale=1.0, divisor=1, hist=None, grad_norm=1.0):
    """A run directory holding what replay reads: steps.csv, config.yaml and (optionally) grad_hist.csv."""
    d.mkdir(parents=True, exist_ok=True)
    with (d / "steps.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["step", "scale", "found_inf", "skipped", "grad_norm", "grad_amax"])
        w.writeheader()
        for i, a in enumerate(amax):
            w.writerow(dict(step=i, scale=scale, found_inf=0, skipped=0, grad_norm=grad_norm, grad_amax=a))
    (d / "config.yaml").write_text(yaml.safe_dump({"train": {"accum_steps": 1, "emulated_accum": divisor},
                                                   "mode": {"name": "fp32", "precision": "fp32"}}))
    if hist is not None:
        with (d / "grad_hist.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, ["step", "source", "at_scale", "log2_bin", "count", "grads"])
            w.writeheader()
            for step, source, bins in hist:
                for b, n in bins.items():
                    w.writerow(dict(step=step, source=source, at_scale=1.0, log2_bin=b, count=n, grads="fp32"))
    return d


def gradscaler_trajectory(amax, **kw):
    """torch.amp.GradScaler's scales when each step's gradient is amax, computed in FP16 at the scaler's scale."""
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.0)
    gs = torch.amp.GradScaler("cpu", **kw)
    out = []
    for a in amax:
        s = gs.get_scale()
        gs.scale(torch.ones(()))
        out.append(s)
        # the FP16 backward's value at this scale (inf when it rounds past 65504), unscaled by the scaler
        p.grad = (torch.tensor(a, dtype=torch.float32) * s).to(torch.float16).float()
        gs.step(opt)
        gs.update()
    return out


def test_replayed_dynamic_is_gradscaler_step_for_step(tmp_path):
    rng = random.Random(1)
    amax = [2.0 ** rng.uniform(-8, 3) for _ in range(300)]  # overflows at 2^16 and below, now and then
    kw = dict(init_scale=2.0**16, growth_interval=20)
    want = gradscaler_trajectory(amax, **kw)
    got = replay(read_run(write_run(tmp_path / "r", amax)), "dynamic", {"growth_interval": 20}, trajectory=True)
    assert [s for _, s, _, _ in got["trajectory"]] == want
    assert got["overflow_steps"] > 5 and got["skipped_steps"] == got["overflow_steps"]


def test_divisor_and_an_overflowed_step(tmp_path):
    # steps 0-1: the step's gradient 1.0 is 32 backwards of 1/32 each; step 2 overflowed in the run, at scale 4096
    r = read_run(write_run(tmp_path / "r", [1.0, 1.0, math.inf], scale=4096.0, divisor=32))
    out = replay(r, "static", {"scale": 2.0**21}, trajectory=True)  # 2^21 / 32 = 65536 >= 65520: overflow
    assert [o for _, _, o, _ in out["trajectory"]] == [True, True, True]
    out = replay(r, "static", {"scale": 2.0**20}, trajectory=True)  # 32768 fits; step 2 overflows at >= 4096
    assert [o for _, _, o, _ in out["trajectory"]] == [False, False, True] and out["uncertain_steps"] == 0
    out = replay(r, "static", {"scale": 1024.0})  # below 4096: step 2's maximum is unknown
    assert out["overflow_steps"] == 0 and out["uncertain_steps"] == 1


def test_flushed_share_is_the_census_at_the_replayed_scale(tmp_path):
    torch.manual_seed(0)
    values = torch.exp2(torch.empty(20000).uniform_(-39, 10)) * torch.randn(20000).sign()
    bins = {k: v for k, v in log2_histogram(values).as_dict().items() if k not in ("zero", "nonfinite")}
    d = write_run(tmp_path / "r", [1.0] * 3, hist=[(0, "param_grad", bins), (0, "activation_grad", bins)])
    for scale in (1.0, 2.0**-3, 1024.0, 2.0**14):
        c = census(values, scale)
        got = replay(read_run(d), "static", {"scale": scale})
        assert got["flushed_param"] == c.underflow / (c.total - c.zero)
        assert got["flushed_activation"] == got["flushed_param"]


def test_headroom_from_the_census_moves_the_overflow_threshold(tmp_path):
    hist = [(0, "param_grad", {-3: 10}), (0, "activation_grad", {-1: 10})]  # activations 2 binades higher
    r = read_run(write_run(tmp_path / "r", [0.125] * 4, hist=hist))
    assert r.headroom == 2
    # 2^17 * 0.125 = 16384 -> * 2^2 = 65536: overflow, where the parameter gradients alone would not
    assert replay(r, "static", {"scale": 2.0**17})["overflow_steps"] == 4
    assert replay(r, "static", {"scale": 2.0**16})["overflow_steps"] == 0


def test_deepspeed_floor_ends_the_replay(tmp_path):
    r = read_run(write_run(tmp_path / "r", [10.0] * 50))
    out = replay(r, "deepspeed", {"init_scale": 2.0**16, "min_scale": 2.0**14})
    # |g| = 10 overflows FP16 at every scale from 2^13 up (10 * 2^13 > 65504). DeepSpeed's rule, by hand:
    # update 0 spends the hysteresis (2 -> 1, scale kept), 1 halves to 2^15, 2 to 2^14 = min_scale, and 3
    # overflows at the minimum: the run ends there, after 4 skipped steps
    assert out["ended_at"] == 3 and "minimum" in out["ended_reason"]
    assert out["steps"] == out["skipped_steps"] == 4 and out["final_scale"] == 2.0**14


def test_the_fp32_fallback_ends_the_replay_where_it_would_fire(tmp_path):
    """docs/replay.md: `fp32_fallback_after` ends the replay at the step the fallback would fire. |g| = 10
    overflows at 2^16, 2^15 and 2^14 (10 * 2^13 > 65504): three skips in a row, the third at step 2."""
    r = read_run(write_run(tmp_path / "r", [10.0] * 50))
    out = replay(r, "dynamic", {"init_scale": 2.0**16, "fp32_fallback_after": 3})
    assert out["ended_at"] == 2 and out["ended_reason"] == "FP32 fallback after 3 consecutive skips"
    assert out["steps"] == out["skipped_steps"] == 3
    assert replay(r, "dynamic", {"init_scale": 2.0**16})["ended_at"] is None  # without the guard it goes on


def test_cli_on_a_recorded_run(tmp_path, capsys):
    d = write_run(tmp_path / "r", [2.0 ** -(i % 5) for i in range(40)])
    assert main(["replay", str(d), "--policy", "dynamic:growth_interval=10", "--policy", "amax-history",
                 "--json", "--trajectory", str(tmp_path / "t.csv")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["dynamic", "amax-history"]
    assert rows[0]["params"] == "growth_interval=10"
    with (tmp_path / "t.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 80
    assert main(["replay", str(d)]) == 0  # every registered policy (the learned ones where their model is fitted)
    out = capsys.readouterr().out
    from lab.diagnose.replay import default_policies
    listed = {name for name, _ in default_policies()}
    assert all(name in out for name in listed) and set(lab.scaling.available()) - listed <= {"rl-controller"}
    for bad in (["replay", str(tmp_path)], ["replay", str(d), "--policy", "nope"],
                ["replay", str(d), "--policy", "dynamic:growth_interval"]):
        assert main(bad) == 2
    assert "error:" in capsys.readouterr().err


def test_a_run_without_grad_amax_is_refused_with_the_reason(tmp_path):
    d = write_run(tmp_path / "r", [1.0])
    text = (d / "steps.csv").read_text().replace(",grad_amax", "").replace(",1.0\n", "\n")
    (d / "steps.csv").write_text(text)
    with pytest.raises(ValueError, match="grad_amax"):
        read_run(d)


def test_the_replay_tables_of_a_study_without_fp32_runs(tmp_path):
    """configs/growth_horizon.yaml trains fp16-dynamic only: replay.csv is written, and the agreement table, which
    replays FP32 runs, says there is nothing to compare instead of failing the study's replay rule."""
    from conftest import tiny_study
    from lab.core.config import resolve_run, validate_study
    from lab.report.replay_table import write_replay_tables
    from lab.run.train import train
    study = tiny_study()
    study["modes"]["fp16-dynamic"] = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    train(resolve_run(validate_study(study), "resnet50", "fp16-dynamic", 0),
          tmp_path / "runs" / "resnet50" / "fp16-dynamic" / "seed0")
    agree = write_replay_tables(tmp_path, tmp_path / "replay.csv", tmp_path / "agree.csv", tmp_path / "agree.md")
    assert agree.empty and (tmp_path / "replay.csv").read_text().startswith("model,")
    assert (tmp_path / "agree.md").read_text().startswith("No FP32 run")

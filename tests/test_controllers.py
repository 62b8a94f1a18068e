"""Learned scales (lab/scaling/learning): the FP8 runs' per-step amax record, the RL controller's environment against
the replay, its training and its frozen policy, `lab fit-controller` / `judge-controllers`, the judge's counts, the
claims engine's non-inferiority kind and the study config's leakage checks."""
import hashlib
import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

import lab.scaling
from conftest import tiny_study
from test_replay import write_run

from lab.cli import main
from lab.core.config import ConfigError, resolve_run, validate_study
from lab.diagnose.replay import ReplayEnv, read_run, replay
from lab.scaling.learning import controller, histories
from lab.scaling.learning.judge import judge
from lab.study.claims.runs import no_more


def hist_rows(steps, scale_bins):
    """Census histograms: at each step, activation and parameter gradients over binades."""
    return [(s, src, {b: 10 + (b % 3) for b in scale_bins}) for s in steps for src in ("activation_grad",
                                                                                       "param_grad")]


@pytest.fixture
def recorded(tmp_path):
    """Two FP32-like runs whose gradients drift over 14 binades, a census every 10 steps."""
    rng = random.Random(2)
    runs = []
    for k in range(2):
        amax = [2.0 ** (-4 - 8 * t / 120 + rng.gauss(0, 0.4)) for t in range(120)]
        runs.append(write_run(tmp_path / f"run{k}", amax, hist=hist_rows(range(0, 120, 10), range(-40, -2))))
    return runs


# --- the environment is the replay ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", [("dynamic", {"growth_interval": 10}), ("amax-history", {"margin": 0, "history": 1}),
                                         ("hysteresis", {"growth_interval": 7})])
def test_a_hand_written_policy_meets_the_same_scales_and_overflows_in_the_controllers_environment(recorded, name,
                                                                                                    params):
    record = read_run(recorded[0])
    policy = lab.scaling.create(name, device="cpu", **params).policy
    needs_amax = policy.needs_grad_amax

    def decide(i, scale, found, amax):
        return lab.scaling.to_f32(policy.update(scale, found, i, None, **({"grad_amax": amax} if needs_amax else {})))
    scales, overflows, _ = controller.episode(ReplayEnv(record), decide, lab.scaling.to_f32(policy.init_scale))
    expected = replay(record, name, params, trajectory=True)["trajectory"]
    assert [(s, f) for _, s, f, _ in expected] == list(zip(scales, overflows))
    assert any(overflows)  # the runs make these policies overflow: the comparison is not of empty lists


def test_the_frozen_controller_replays_as_it_rolled_out_in_training(recorded, tmp_path):
    envs = [ReplayEnv(read_run(r)) for r in recorded]
    out = controller.train(envs, seed=3, iterations=4)
    assert out == controller.train(envs, seed=3, iterations=4)  # seeded: the same weights
    path = tmp_path / "rl.json"
    from lab.scaling.learning import artefact
    artefact.save({"kind": "rl-linear", "features": list(controller.FEATURES), "coef": out["coef"]}, path)
    weights = torch.tensor(out["coef"], dtype=torch.float64).reshape(out["shape"])
    _, actions, _, skipped, _ = controller.rollout(envs[0], weights, 1024.0, None)
    r = replay(envs[0].record, "rl-controller", {"model": str(path)}, trajectory=True)
    scales = [s for _, s, _, _ in r["trajectory"]]
    expected = [1024.0]
    for a in actions.tolist()[:-1]:
        expected.append(controller.next_scale(expected[-1], a))
    assert scales == expected and r["skipped_steps"] == skipped


def test_the_controller_resumes_from_its_state(recorded, tmp_path):
    out = controller.train([ReplayEnv(read_run(recorded[0]))], seed=0, iterations=2)
    path = tmp_path / "rl.json"
    from lab.scaling.learning import artefact
    artefact.save({"kind": "rl-linear", "features": list(controller.FEATURES), "coef": out["coef"]}, path)
    a = lab.scaling.create("rl-controller", device="cpu", model=str(path)).policy
    seq = [(2.0 ** (-3 - 0.1 * i), i % 17 == 5) for i in range(40)]
    scale, seen = 1024.0, []
    for i, (amax, inf) in enumerate(seq):
        scale = a.update(scale, inf, i, grad_amax=math.inf if inf else amax)
        seen.append(scale)
        if i == 19:
            state, mid = json.loads(json.dumps(a.state_dict())), scale
    b = lab.scaling.create("rl-controller", device="cpu", model=str(path)).policy
    b.load_state_dict(state)
    scale = mid
    for i, (amax, inf) in list(enumerate(seq))[20:]:
        scale = b.update(scale, inf, i, grad_amax=math.inf if inf else amax)
        assert scale == seen[i]


def test_a_missing_or_foreign_model_is_named(tmp_path):
    with pytest.raises(ValueError, match="no fitted scale model"):
        replay(read_run(write_run(tmp_path / "r", [1.0] * 3)), "rl-controller", {"model": str(tmp_path / "x.json")})
    (tmp_path / "bad.json").write_text(json.dumps({"format": "loss-scale-lab/scale-model/1", "kind": "quantile-linear",
                                                   "coef": [1.0]}))
    with pytest.raises(ValueError, match="expected a .* of kind 'rl-linear'"):
        lab.scaling.check("rl-controller", model=str(tmp_path / "bad.json"))


# --- the command line ---------------------------------------------------------------------------------------------
def test_fit_controller_writes_a_versioned_model_that_names_its_runs(recorded, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["fit-controller", *map(str, recorded), "--out", str(out), "--quantile", "0.9"]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "loss-scale-lab/scale-model/1" and data["kind"] == "quantile-linear"
    assert [r["path"] for r in data["runs"]] == [str(r) for r in recorded]
    # each run's files as read (steps.csv, config.yaml and grad_hist.csv, through the replay's reader), each with the
    # SHA-256 of its bytes
    for r in data["runs"]:
        assert r["files"] == {name: hashlib.sha256((Path(r["path"]) / name).read_bytes()).hexdigest()
                              for name in ("config.yaml", "grad_hist.csv", "steps.csv")}
    assert data["quantile"] == 0.9
    # the policy reads it: replayed over a run, the learned predictor gives its scales
    res = replay(read_run(recorded[0]), "amax-predicted", {"predictor": {"name": "learned", "model": str(out)}})
    assert res["steps"] == 120
    data["features"] = data["features"][::-1]
    out.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="fit it again"):
        lab.scaling.check("amax-predicted", predictor={"name": "learned", "model": str(out)})


def test_a_models_digests_cover_every_file_its_fit_read(recorded, tmp_path):
    """The RL fit replays each run at its divisor, config.yaml's train.emulated_accum: changing only that value
    changes the coefficients, and so the digest the artefact lists for that run's config.yaml (and for nothing
    else)."""
    fitted = {}
    for divisor in (1, 8):
        config = recorded[0] / "config.yaml"
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                          "train": {"accum_steps": 1, "emulated_accum": divisor}}))
        out = tmp_path / f"rl-{divisor}.json"
        assert main(["fit-controller", *map(str, recorded), "--controller", "rl", "--iterations", "2",
                     "--out", str(out)]) == 0
        fitted[divisor] = json.loads(out.read_text())
    one, eight = fitted[1], fitted[8]
    assert one["coef"] != eight["coef"]  # the fit read the value
    assert [sorted(r["files"]) for r in one["runs"]] == [["config.yaml", "grad_hist.csv", "steps.csv"]] * 2
    changed = [(i, name) for i, (a, b) in enumerate(zip(one["runs"], eight["runs"]))
               for name in a["files"] if a["files"][name] != b["files"][name]]
    assert changed == [(0, "config.yaml")]


def test_judge_controllers_tables_and_the_front(recorded, tmp_path):
    models = tmp_path / "models"  # write_run's config names no family: the judge reads the family None
    assert main(["fit-controller", str(recorded[0]), "--out", str(models / "learned-fp16-without-None.json")]) == 0
    assert main(["fit-controller", str(recorded[0]), "--controller", "rl", "--iterations", "2",
                 "--out", str(models / "rl-fp16-without-None.json")]) == 0
    assert main(["judge-controllers", "--fp16", str(recorded[1]), "--models", str(models),
                 "--out", str(tmp_path / "t")]) == 0
    table = pd.read_csv(tmp_path / "t" / "controllers_fp16.csv")
    assert {"dynamic", "amax-history", "amax-predicted:learned", "rl-controller"} <= set(table["policy"])
    for row in table.itertuples():  # front: nothing else skips no more and flushes no more, one of them less
        others = table[(table.skipped_per_run <= row.skipped_per_run) & (table.flushed_activation <=
                       row.flushed_activation) & ((table.skipped_per_run < row.skipped_per_run) |
                                                   (table.flushed_activation < row.flushed_activation))]
        assert row.front == others.empty


def test_pareto_front_keeps_exactly_what_nothing_dominates():
    from lab.report.pareto_figure import front_steps
    from lab.scaling.learning.tables import pareto_front
    nan = float("nan")
    # (0, 5) and (2, 1) and (4, 0) trade off; (2, 1) twice: both on it; (3, 1) and (0, 6): one no better, one worse;
    # (5, nan): a missing value is the worst
    xs = [0, 2, 2, 4, 3, 0, 5, 6]
    ys = [5, 1, 1, 0, 1, 6, nan, 0]
    assert pareto_front(xs, ys) == [True, True, True, True, False, False, False, False]
    assert front_steps(xs, ys, pareto_front(xs, ys)) == ([0, 2, 4], [5, 1, 0])  # the staircase: each spot once
    assert pareto_front([1.0], [1.0]) == [True] and pareto_front([], []) == []


def test_the_pareto_figure_draws_the_front_and_numbers_every_point_once_apart():
    from lab.report.pareto_figure import draw, front_steps
    from lab.scaling.learning.tables import pareto_front
    # a crowd: five rules on one spot with two just beside it, three a hair apart, the rest spread (the
    # MobileNet-v2 table's shape)
    xs = [1e-2] * 5 + [1.20e-2, 1.22e-2, 1.24e-2, 1e-3, 1.0, 3e-2, 5e-3, 1.3e-2, 1.7e-2]
    ys = [4.5] * 5 + [0.0, 0.0, 0.0, 20.0, 0.0, 0.2, 0.4, 4.5, 4.5]
    points = pd.DataFrame({"x": xs, "y": ys, "name": [f"rule{i}" for i in range(len(xs))],
                           "kind": ["a"] * 6 + ["b"] * (len(xs) - 6)})
    front = pareto_front(xs, ys)
    fig = draw(points, front, {"a": "tab:gray", "b": "tab:red"}, {"xlabel": "x", "ylabel": "y", "title": "t"},
               {"x": {"value": "symlog", "linthresh": 1e-4}, "y": {"value": "symlog", "linthresh": 1}})
    ax = fig.axes[0]
    numbers = [n for t in ax.texts for n in t.get_text().split(",")]
    assert sorted(map(int, numbers)) == list(range(1, len(xs) + 1))  # each point's number once
    assert "1,2,3,4,5" in {t.get_text() for t in ax.texts}  # markers on one spot share one label
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    # the staircase through the front: x rising, y falling, each spot once, nothing dominated on it
    step = ax.lines[0]
    fx, fy = front_steps(xs, ys, front)
    assert (list(step.get_xdata()), list(step.get_ydata())) == (fx, fy) == ([1e-3, 5e-3, 1.20e-2], [20.0, 0.4, 0.0])
    keyed = [t.get_text() for t in fig.axes[1].texts][1:]
    assert keyed == [f"{i + 1:>2}  rule{i}" for i in range(len(xs))]


def test_a_rule_with_no_flushed_share_is_keyed_but_not_placed():
    from lab.report.pareto_figure import draw
    points = pd.DataFrame({"x": [1e-3, float("nan"), 1e-2], "y": [1.0, 0.0, 0.0], "name": ["a", "b", "c"],
                           "kind": ["k"] * 3})
    fig = draw(points, [True, False, True], {"k": "tab:blue"}, {"xlabel": "x", "ylabel": "y", "title": "t"},
               {"x": {"value": "symlog", "linthresh": 1e-4}})
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["1", "3"]
    assert [t.get_text() for t in fig.axes[1].texts][1:] == [" 1  a", " 2  b", " 3  c"]


def test_the_judge_takes_the_model_that_never_saw_the_family(tmp_path):
    from lab.scaling.learning.tables import held_out_model

    def artefact(name, families):
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": [{"model": f"{f}_learn"} for f in families]}))
    artefact("learned-fp16", ["lm", "vit"])
    assert held_out_model(tmp_path, "learned-fp16", "vlm") == tmp_path / "learned-fp16.json"  # held out whole
    with pytest.raises(ValueError, match="learned from family 'lm'"):  # the full model saw the LM: a leak
        held_out_model(tmp_path, "learned-fp16", "lm")
    artefact("learned-fp16-without-lm", ["vit"])
    assert held_out_model(tmp_path, "learned-fp16", "lm") == tmp_path / "learned-fp16-without-lm.json"


# --- the FP8 judge --------------------------------------------------------------------------------------------
def test_judge_counts_clipped_steps_and_unused_binades():
    rising = histories.History("r", "l/grad_output", "grad_output", torch.exp2(torch.arange(20.0, dtype=torch.float64)))
    falling = histories.History("f", "l/input", "input", torch.exp2(-torch.arange(20.0, dtype=torch.float64)))
    recent = {r["role"]: r for r in judge([rising, falling], "most_recent", 16)}
    # rising by a binade each step: every step after the first clips; falling: one binade unused every step
    assert recent["grad_output"]["clipped_pct"] == pytest.approx(100 * 19 / 20)
    assert recent["input"]["clipped_pct"] == 0 and recent["input"]["unused_binades"] == pytest.approx(
        (math.log2(448.0) + 19 * 1.0) / 20)  # step 0 at scale 1 (TE's initial), then 1 binade each
    mx = {r["role"]: r for r in judge([falling], "max", 4)}["input"]
    # max over 4 steps: after step 4, the amax sits 4 binades under the history's max
    assert mx["unused_binades"] == pytest.approx((math.log2(448.0) + 1 + 2 + 3 + 16 * 4) / 20)


# --- FP8 runs record every tensor's amax at every step ----------------------------------------------------------
def fp8_study():
    s = tiny_study(models={"vit": {"preset": "vit-tiny-digits"}},
                   modes={"cur": {"precision": "bf16", "recipe": "fp8-current"},
                          "del": {"precision": "bf16", "recipe": {"name": "fp8-delayed", "history_len": 4,
                                                                   "algorithm": "ema"}}})
    s["train"].update(max_steps=6, epochs=3, census_every=2, checkpoint_every=3, checkpoint_minutes=0)
    return validate_study(s)


def test_fp8_runs_record_each_linears_amax_at_every_step(tmp_path, monkeypatch):
    from lab.fp8.linear import RecipeLinear
    from lab.run.train import train
    seen = {}
    forward = RecipeLinear.forward

    def spy(self, x):  # what the layer multiplies: its input in the autocast dtype, its weight before the step
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        if torch.is_grad_enabled() and spy.in_step:  # not a census's or an evaluation's forward
            step = spy.step
            key = (step, self.lab_name)
            prev = seen.get(key, (0.0, 0.0))
            seen[key] = (max(prev[0], float(x.to(dt).abs().max())), float(self.weight.abs().max()))
        return forward(self, x)
    spy.step, spy.in_step = 0, False
    monkeypatch.setattr(RecipeLinear, "forward", spy)
    import lab.fp8.state as state_mod
    begin, end = state_mod.RecipeState.begin_step, state_mod.RecipeState.end_step

    def begin_step(self, step):
        spy.step, spy.in_step = step, True
        return begin(self, step)

    def end_step(self):
        spy.in_step = False
        return end(self)
    monkeypatch.setattr(state_mod.RecipeState, "begin_step", begin_step)
    monkeypatch.setattr(state_mod.RecipeState, "end_step", end_step)
    train(resolve_run(fp8_study(), "vit", "cur", 0), tmp_path / "run")
    rows = pd.read_csv(tmp_path / "run" / "fp8_amax.csv")
    assert sorted(rows["step"].unique()) == list(range(6))
    for (step, layer), (x_amax, w_amax) in seen.items():
        got = rows[(rows.step == step) & (rows.layer == layer)].set_index("role")["amax"]
        assert got["input"] == x_amax and got["weight"] == w_amax
        assert got["grad_output"] > 0


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "fp8-blockwise", "fp8-delayed", "mxfp8", "nvfp4"])
def test_the_amax_record_is_each_operands_largest_magnitude(tmp_path, recipe):
    """fp8_amax.csv against the operands themselves (hooks on every recipe layer, |t|.max in FP64, the largest over
    a step's two micro-batches): the record reads the amaxes current scaling computed already (Quantized.amax: per
    tensor, row, tile or block) where it can, and t itself where not (delayed scaling, MX, NVFP4 and its
    Hadamard-rotated weight-gradient GEMM): the same value either way."""
    import torch.nn as nn
    import lab
    from lab.fp8 import convert, create_recipe
    from lab.fp8.linear import recipe_layers
    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128)), create_recipe(recipe))
    seen = {}

    def take(name, role, t):
        key = (take.step, name, role)
        seen[key] = max(seen.get(key, 0.0), float(t.detach().double().abs().max()))
    for m in recipe_layers(model):
        m.register_forward_pre_hook(lambda mod, args: (take(mod.lab_name, "input", args[0].to(torch.bfloat16)),
                                                      take(mod.lab_name, "weight", mod.weight)) and None)
        m.register_full_backward_pre_hook(lambda mod, go: take(mod.lab_name, "grad_output", go[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with lab.record(model, None, out=tmp_path / "run", optimizer=opt, precision="bf16") as rec:
        for step in range(3):
            take.step = step
            for micro in range(2):
                x = torch.randn(2, 64, 128, generator=g) * 2.0 ** (4 * micro - 2)
                with lab.autocast("cpu", torch.bfloat16):
                    loss = model(x).float().pow(2).mean() * 2.0 ** (-6 * step)
                loss.backward()
            opt.step(), rec.step(loss), opt.zero_grad(set_to_none=True)
    rows = pd.read_csv(tmp_path / "run" / "fp8_amax.csv", dtype={"layer": str})  # layers "0" and "2"
    assert len(rows) == len(seen) == 3 * 2 * 3
    for row in rows.itertuples():
        assert row.amax == seen[(row.step, row.layer, row.role)], row


def test_fp8_amax_record_survives_a_crash_and_resume(tmp_path, monkeypatch):
    import lab.run.loop as L
    from lab.run.train import train
    study = fp8_study()
    train(resolve_run(study, "vit", "del", 0), tmp_path / "whole")
    calls = {"n": 0}
    fb = L.forward_backward

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # in step 4, after the checkpoint of step 3
            raise KeyboardInterrupt
        return fb(*a, **k)
    monkeypatch.setattr(L, "forward_backward", crash)
    with pytest.raises(KeyboardInterrupt):
        train(resolve_run(study, "vit", "del", 0), tmp_path / "cut")
    monkeypatch.setattr(L, "forward_backward", fb)
    train(resolve_run(study, "vit", "del", 0), tmp_path / "cut")
    assert (tmp_path / "cut" / "fp8_amax.csv").read_text() == (tmp_path / "whole" / "fp8_amax.csv").read_text()
    assert (tmp_path / "cut" / "steps.csv").read_text() == (tmp_path / "whole" / "steps.csv").read_text()


# --- claims and config ------------------------------------------------------------------------------------------
def test_no_more_is_non_inferiority():
    reach = {"level": 0.05, "power": 0.8, "max_seeds": 20}

    def table(delta):
        rows = [dict(mode=m, seed=s, x=1.0 + (delta + 0.01 * ((s * 7) % 5 - 2) if m == "a" else 0.0))
                for m in ("a", "b") for s in range(8)]
        return {"runs": pd.DataFrame(rows)}
    spec = {"column": "x", "left": "a", "right": "b", "margin": 0.1}
    good, bad = no_more(spec, table(-0.05), reach), no_more(spec, table(0.3), reach)
    assert good.p_support < 0.01 and not good.contradicted
    assert bad.p_support > 0.5 and bad.contradicted


def test_a_model_that_learns_from_a_judged_seed_or_its_held_out_family_is_refused():
    s = tiny_study()
    s["controllers"] = {"m-without-vit": {"learn_from": {"vit": ["fp32"]}}}
    with pytest.raises(ConfigError, match="named without 'vit' but learns from it"):
        validate_study(s)
    s["controllers"] = {"m": {"learn_from": {"vit": ["fp32"]}}}
    s["judge"] = {"fp16": {"resnet50": ["fp32"]}}
    with pytest.raises(ConfigError, match=r"learns from seeds \[0\] that judge: replays"):
        validate_study(s)


# --- docs/controllers.md's "Add a predictor", done as written ---------------------------------------------------
def test_a_new_predictor_in_one_file_and_one_line_is_listed_by_replay(repo_copy, tmp_path):
    import re
    import subprocess
    import sys
    from conftest import REPO
    section = (REPO / "docs" / "controllers.md").read_text().split("## Add a predictor", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    code = next(c for lang, c in blocks if lang == "python")
    line = next(c for lang, c in blocks if lang == "yaml")
    target = code.splitlines()[0].lstrip("# ").strip()
    assert target.startswith("lab/scaling/predictors/")
    (repo_copy / target).write_text(code)
    run = write_run(tmp_path / "run", [2.0 ** -(i % 7) for i in range(40)])
    (run / "fp8_amax.csv").write_text("step,layer,role,amax\n" + "".join(
        f"{i},fc,{role},{2.0 ** -(i % 5)!r}\n" for i in range(40) for role in ("input", "weight", "grad_output")))
    out = subprocess.run([sys.executable, "-m", "lab", "replay", str(run)], cwd=repo_copy, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    (name,) = re.findall(r'register_predictor\("([^"]+)"\)', code)
    assert f"predictor={name}" in out.stdout  # FP16: amax-predicted with it, over steps.csv
    assert re.search(rf"^  {name} +16 ", out.stdout, flags=re.M)  # FP8: delayed scaling with it, over fp8_amax.csv
    study = tiny_study(models={"vit": {"preset": "vit-tiny-digits"}}, modes={"fp32": {"precision": "fp32"}})
    study["modes"].update(yaml.safe_load(line))
    config = repo_copy / "configs" / "mine.yaml"
    config.write_text(yaml.safe_dump(study))
    ok = subprocess.run([sys.executable, "-m", "lab", "validate", "--config", str(config)], cwd=repo_copy,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_lab_record_writes_the_amax_of_the_labs_and_torchaos_layers_alike(tmp_path):
    """lab.record on the same GPT under the lab's fp8-current and torchao's tensorwise (their GEMMs equal bit for bit,
    tests/test_fp8_linear.py): the recipe layers' own record and the hooks on torchao's layers give the same file."""
    pytest.importorskip("torchao")
    from test_diagnose_fp8 import record
    record(tmp_path / "lab", "fp8-current", steps=4)
    record(tmp_path / "ao", None, steps=4, torchao="tensorwise")
    lab_rows, ao_rows = (pd.read_csv(tmp_path / d / "run" / "fp8_amax.csv") for d in ("lab", "ao"))
    assert sorted(lab_rows.step.unique()) == [0, 1, 2, 3] and (lab_rows.amax > 0).all()
    assert lab_rows.equals(ao_rows)


def test_fit_controller_refuses_bad_input_in_one_line(recorded, tmp_path, capsys):
    out = str(tmp_path / "m.json")
    for argv in (["fit-controller", str(tmp_path / "nope"), "--out", out],
                 ["fit-controller", str(recorded[0]), "--out", out, "--quantile", "1.5"],
                 ["fit-controller", str(recorded[0]), "--history", "fp8", "--out", out]):  # no fp8_amax.csv there
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: fit-controller:") and "Traceback" not in err


def test_a_delayed_first_step_from_its_own_amax_is_current_scaling():
    """fp8-delayed's `initial: current`: with nothing in the history (the first step) each tensor is scaled from its
    own amax, which is current scaling exactly (the same bits), where TE's scale 1 flushes the small gradients."""
    import torch.nn as nn
    from lab.fp8 import create_recipe
    from lab.fp8.linear import convert

    def step(recipe):
        torch.manual_seed(0)
        model = convert(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), create_recipe(recipe))
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
        out = model(x)
        (out.float().pow(2).mean() * 1e-4).backward()  # gradients ~1e-6: under E5M2's 2^-16 at scale 1
        return out.detach(), [p.grad for p in model.parameters()]
    cur_out, cur_grads = step("fp8-current")
    init_out, init_grads = step({"name": "fp8-delayed", "initial": "current"})
    one_out, one_grads = step("fp8-delayed")
    assert torch.equal(cur_out, init_out) and all(torch.equal(a, b) for a, b in zip(cur_grads, init_grads))
    assert not all(torch.equal(a, b) for a, b in zip(cur_grads, one_grads))  # TE's scale 1 loses them
    with pytest.raises(ValueError, match="initial must be one"):
        create_recipe({"name": "fp8-delayed", "initial": "first"})

"""Planted faults (lab/run/faults.py): every policy counts them exactly where they were planted.

Each run trains a small ViT with inf/NaN planted at known steps and no overflow of its own (moderate initial
scales). The prediction for each step comes from the policy's rule written out here, independently of
lab/scaling: found_inf exactly at the planted steps, skipped where the rule skips, the scale each step used,
and the layer and source the attribution must name.
"""
import copy
import io
import math
import os
import signal

import pandas as pd
import pytest

from conftest import tiny_study
from lab.core.config import ConfigError, resolve_run, validate_study
from lab.diagnose import diagnose
from lab.run.train import train

ACT = {"step": 2, "into": "activation_grad", "module": "blocks.1.attn.proj", "value": "inf"}
PARAM = {"step": 5, "into": "param_grad", "param": "head.weight", "value": "nan"}
LOSS = {"step": 6, "into": "loss", "value": "-inf"}
FAULTS = [ACT, PARAM, LOSS]
# the first non-finite gradient in backward order, for each fault: the activation gradient at the module's
# output; the parameter's owner; for the loss, the gradient at the output of the model's last layer (head)
REPLAYED = {2: ("blocks.1.attn.proj", "activation_grad"), 5: ("head", "param_grad"), 6: ("head", "activation_grad")}
STEPS = 10


def study_with(scaler: dict, faults=FAULTS, **train) -> dict:
    s = tiny_study()
    s["models"] = {"vit": {"preset": "vit-tiny-digits"}}
    s["modes"] = {"m": {"precision": "fp16", "scaler": scaler}}
    s["train"].update(max_steps=STEPS, census_every=1, log_every=1, faults=copy.deepcopy(faults), **train)
    return validate_study(s)


def run(tmp_path, scaler, faults=FAULTS, name="run", **train_kw):
    cfg = resolve_run(study_with(scaler, faults, **train_kw), "vit", "m", 0)
    out = tmp_path / name
    metrics = train(cfg, out, progress=io.StringIO())
    return metrics, pd.read_csv(out / "steps.csv", keep_default_na=False), out


# --- each policy's rule, written out: (scale used at each step, skipped?) given the overflow steps ---------
def rule_static(scale, found):
    return [scale] * len(found), list(found)


def rule_dynamic(init, interval, found):
    scales, tracker, s = [], 0, init
    for f in found:
        scales.append(s)
        if f:
            s, tracker = s * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                s, tracker = s * 2, 0
    return scales, list(found)


def rule_hysteresis(init, interval, hysteresis, found):
    """Megatron-LM's DynamicGradScaler: back off only when the hysteresis budget is spent."""
    scales, growth, hyst, s = [], 0, hysteresis, init
    for f in found:
        scales.append(s)
        if f:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                s = max(s * 0.5, 1.0)
        else:
            growth += 1
            if growth == interval:
                growth, hyst, s = 0, hysteresis, s * 2
    return scales, list(found)


def rule_warmup(init, warmup, interval, max_scale, found):
    scales, tracker, s = [], 0, init
    for step, f in enumerate(found):
        scales.append(s)
        if f:
            s, tracker = s * 0.5, 0
        elif step >= warmup:
            tracker += 1
            if tracker >= interval:
                tracker, s = 0, min(s * 2, max_scale)
    return scales, list(found)


def rule_halve_on_overflow(init, found):  # gradnorm inside its warm-up: only the overflow rule acts
    scales, s = [], init
    for f in found:
        scales.append(s)
        s = s * 0.5 if f else s
    return scales, list(found)


FOUND = [step in REPLAYED for step in range(STEPS)]
POLICIES = {
    "static": ({"policy": "static", "scale": 128}, rule_static(128.0, FOUND)),
    "dynamic": ({"policy": "dynamic", "init_scale": 1024, "growth_interval": 2}, rule_dynamic(1024.0, 2, FOUND)),
    "hysteresis": ({"policy": "hysteresis", "init_scale": 1024, "growth_interval": 2, "hysteresis": 2},
                   rule_hysteresis(1024.0, 2, 2, FOUND)),
    "warmup": ({"policy": "warmup", "init_scale": 1024, "warmup_steps": 1, "growth_interval": 2,
                "max_scale": 4096}, rule_warmup(1024.0, 1, 2, 4096.0, FOUND)),
    "gradnorm": ({"policy": "gradnorm", "init_scale": 1024, "warmup_steps": 100},
                 rule_halve_on_overflow(1024.0, FOUND)),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_each_policy_counts_planted_faults_exactly(tmp_path, policy):
    scaler, (scales, skipped) = POLICIES[policy]
    metrics, steps, out = run(tmp_path, scaler)
    assert list(steps["step"]) == list(range(STEPS))
    assert list(steps["found_inf"].astype(bool)) == FOUND           # overflow exactly at the planted steps
    assert list(steps["skipped"].astype(bool)) == skipped
    assert list(steps["scale"].astype(float)) == scales              # the rule's trajectory, step for step
    for step in range(STEPS):
        row = steps.iloc[step]
        want = REPLAYED.get(step, ("", ""))
        assert (row["first_nonfinite_layer"], row["first_nonfinite_source"]) == want, step
    assert metrics["overflow_steps"] == metrics["skipped_steps"] == 3
    assert metrics["planted_steps"] == [2, 5, 6] and metrics["faults_planned"] == 3
    assert len(metrics["faults_planted"]) == 3
    assert metrics["first_overflow_step"] == 2 and metrics["first_nonfinite_layer"] == "blocks.1.attn.proj"
    d = diagnose(out)
    assert (d.overflow_steps, d.skipped_steps, d.first_overflow_step) == (3, 3, 2)
    assert d.planted_steps == [2, 5, 6] and d.unplanted_overflow_steps == []
    assert d.overflow_layers == {f"{layer} ({source})": 1 for layer, source in REPLAYED.values()}
    assert any(f.code == "planted" for f in d.findings)


def test_diagnose_names_a_missed_fault_and_the_census_overflow_layers(tmp_path):
    """diagnose.md: the census's overflowing layers are named with their counts and the smallest scale each
    overflowed at (summed from census.csv here); a planted fault with no overflow counted at its step (a counting
    bug, made here by editing the run's steps.csv and metrics.json) is a problem naming the step."""
    import json
    _, steps, out = run(tmp_path, POLICIES["static"][0])
    census = pd.read_csv(out / "census.csv")
    per_layer = census[(census["layer"] != "__total__") & (census["overflow"] > 0)].groupby("layer")
    counts, first = per_layer["overflow"].sum(), per_layer["at_scale"].min()
    found = {f.code: f for f in diagnose(out).findings}
    assert "planted" in found and "planted_missed" not in found
    top = counts.sort_values(ascending=False, kind="stable").head(3)
    assert found["census_overflow_layers"].evidence["layers"] == {k: int(v) for k, v in top.items()}
    for layer in top.index:
        assert f"{layer} ({int(counts[layer])} values, from scale {first[layer]:g})" in \
            found["census_overflow_layers"].message
    steps.loc[steps["step"] == 5, "found_inf"] = 0
    steps.to_csv(out / "steps.csv", index=False)
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["planted_steps"] = [2, 6]
    (out / "metrics.json").write_text(json.dumps(metrics))
    found = {f.code: f for f in diagnose(out).findings}
    missed = found["planted_missed"]
    assert missed.severity == "problem" and "planted" not in found
    assert missed.evidence["missed"] == [5] and missed.evidence["not_fired"] == [5]
    assert "no overflow was counted at 5" in missed.message and "never fired at 5" in missed.message


def test_no_scaling_applies_the_planted_inf_and_the_run_diverges(tmp_path):
    metrics, steps, out = run(tmp_path, {"policy": "none"})
    # step 2 is applied: the weights become NaN, so step 3's loss is NaN and the run stops there, diverged
    assert list(steps["step"]) == [0, 1, 2, 3]
    assert list(steps["found_inf"]) == [0, 0, 1, 1] and list(steps["skipped"]) == [0, 0, 0, 0]
    assert list(steps["scale"]) == [1.0] * 4 and math.isnan(float(steps["loss"].iloc[3]))
    # a policy that applies overflow steps cannot replay them: parameter-gradient flags name the first
    # non-finite parameter gradient, the planted module's own weight gradient
    assert (steps.iloc[2]["first_nonfinite_layer"], steps.iloc[2]["first_nonfinite_source"]) == \
        ("blocks.1.attn.proj", "param_grad")
    assert metrics["diverged"] and "non-finite by step 3" in metrics["diverged_reason"]
    assert metrics["planted_steps"] == [2] and metrics["faults_planned"] == 3
    d = diagnose(out)
    assert d.planted_steps == [2] and d.unplanted_overflow_steps == [3]  # step 3: the NaN weights' own
    assert any(f.code == "overflow_applied" for f in d.findings)


def test_consecutive_faults_trigger_the_fp32_fallback_and_are_still_skipped_after_it(tmp_path):
    faults = [dict(ACT, step=4), dict(PARAM, step=5), dict(ACT, step=8)]
    metrics, steps, _ = run(tmp_path, {"policy": "dynamic", "init_scale": 1024, "growth_interval": 100,
                                       "fp32_fallback_after": 2}, faults)
    assert list(steps.loc[steps["found_inf"] == 1, "step"]) == [4, 5, 8]
    assert list(steps.loc[steps["skipped"] == 1, "step"]) == [4, 5, 8]
    assert metrics["fallback_step"] == 5                        # the second consecutive skip
    assert list(steps["precision"]) == ["fp16"] * 5 + ["fp32"] * 5
    assert list(steps["scale"]) == [1024.0] * 5 + [512.0] + [1.0] * 4
    assert steps.iloc[8]["first_nonfinite_layer"] == "blocks.1.attn.proj"  # attribution in FP32 too


def test_fault_in_a_later_micro_batch_of_an_accumulated_step(tmp_path):
    faults = [dict(ACT, step=1, micro=1), dict(LOSS, step=3, micro=0), dict(LOSS, step=4, micro=1)]
    _, steps, _ = run(tmp_path, {"policy": "static", "scale": 128}, faults, accum_steps=2)
    assert list(steps.loc[steps["found_inf"] == 1, "step"]) == [1, 3, 4]
    assert steps.iloc[1]["first_nonfinite_layer"] == "blocks.1.attn.proj"
    # steps.csv's loss is the step's last micro-batch's: the loss fault shows there only when planted in it
    assert math.isfinite(float(steps.iloc[3]["loss"])) and float(steps.iloc[4]["loss"]) == -math.inf


def test_a_run_with_faults_resumes_exactly(tmp_path):
    """SIGTERM mid-run (a checkpoint at the step's end), resume: the same steps.csv and metrics as one run."""
    scaler = POLICIES["hysteresis"][0]
    whole, steps_whole, _ = run(tmp_path, scaler, name="whole")

    class TermAtStep4(io.StringIO):
        def write(self, text):
            if "step 4/" in text:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().write(text)

    cfg = resolve_run(study_with(scaler), "vit", "m", 0)
    out = tmp_path / "cut"
    with pytest.raises(Exception, match="SIGTERM"):
        train(cfg, out, progress=TermAtStep4())
    assert not (out / "metrics.json").exists() and list((out / "checkpoint").iterdir())
    progress = io.StringIO()
    resumed = train(cfg, out, progress=progress)
    # it resumed from the checkpoint (starting over would write the same files): no step before the cut again
    text = progress.getvalue()
    assert "resuming from" in text and "step 1/" not in text and "step 5/" in text, text[:500]
    assert pd.read_csv(out / "steps.csv").drop(columns=[]).equals(pd.read_csv(tmp_path / "whole" / "steps.csv"))
    for key in ("overflow_steps", "skipped_steps", "faults_planted", "planted_steps", "final_scale", "final_top1"):
        assert resumed[key] == whole[key], key


@pytest.mark.parametrize("fault, message", [
    ({"step": 1, "into": "loss", "value": "inf", "module": "head"}, "train.faults[0].module: a fault into loss"),
    ({"step": 1, "into": "param_grad", "value": "inf"}, "train.faults[0].param: a fault into param_grad needs"),
    ({"step": 1, "into": "activation_grad", "module": "blocks.1.attn", "value": "inf"},
     "expected a leaf module (one without submodules) of vit-tiny-digits, found 'blocks.1.attn'"),
    ({"step": 1, "into": "activation_grad", "module": "blocks.1.atn.proj", "value": "inf"},
     "did you mean 'blocks.1.attn.proj'"),
    ({"step": 1, "into": "param_grad", "param": "head.wieght", "value": "inf"}, "did you mean 'head.weight'"),
    ({"step": 1, "into": "activation", "module": "blocks.1.mpl", "value": "inf"},
     "expected a module of vit-tiny-digits, found 'blocks.1.mpl'"),
    ({"step": 1, "into": "activation", "param": "head.weight", "value": "inf"},
     "a fault into activation takes a module"),
    ({"step": 1, "micro": 2, "into": "loss", "value": "nan"}, "micro: expected < train.accum_steps (1), found 2"),
    ({"step": 1, "into": "loss", "value": 1.0e9}, "train.faults[0].value"),
    ({"step": -1, "into": "loss", "value": "inf"}, "train.faults[0].step"),
])
def test_bad_faults_are_refused_before_any_run(fault, message):
    with pytest.raises(ConfigError, match=None) as err:
        study_with({"policy": "static", "scale": 128}, [fault])
    assert message in str(err.value)


def test_a_fault_for_a_rank_the_run_does_not_have_is_refused(tmp_path):
    cfg = resolve_run(study_with({"policy": "static", "scale": 128}, [dict(LOSS, rank=1)]), "vit", "m", 0)
    with pytest.raises(ConfigError, match=r"train.faults\[0\].rank: expected a rank below the run's 1 process"):
        train(cfg, tmp_path / "out", progress=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_train_refuses_a_fault_set_on_the_command_line_before_writing(tmp_path):
    from lab.core.config import apply_overrides
    cfg = resolve_run(study_with({"policy": "static", "scale": 128}, []), "vit", "m", 0)
    cfg = apply_overrides(cfg, ['train.faults=[{step: 1, into: activation_grad, module: nope, value: inf}]'])
    with pytest.raises(ConfigError, match="train.faults\\[0\\].module"):
        train(cfg, tmp_path / "out", progress=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_report_shows_the_planted_steps(tmp_path):
    """summary.md lists each mode's planted steps and counts; the scale figure draws a line at each."""
    from lab.report import figures, load as results
    from lab.study import aggregate
    _, _, out = run(tmp_path, POLICIES["dynamic"][0], name="runs/vit/m/seed0")
    md = tmp_path / "summary.md"
    aggregate.aggregate([out], tmp_path / "summary.csv", md)
    assert "Planted faults, vit / m: steps 2, 5, 6; counted 3 overflow and 3 skipped steps" in md.read_text()
    metrics = results.load_metrics(tmp_path)
    assert figures.planted_steps(metrics, "vit") == [2, 5, 6]
    fig = figures.scale_figure(results.load_steps(tmp_path), "vit", planted=[2, 5, 6])
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "planted"]
    assert sorted(ln.get_xdata()[0] for ln in lines) == [2, 5, 6]


def test_a_forward_overflow_is_located_in_a_lab_run_and_only_there(tmp_path):
    """A forward output beyond FP16's range (into: activation, T5's feed-forward past 65504): the replay of the skipped
    step names the module, in forward order, with its largest magnitude; the gradient faults (whose forward is in
    range) leave the forward-range columns empty; `lab diagnose` names the module and advises keeping it in FP32."""
    fwd = {"step": 3, "into": "activation", "module": "blocks.0.mlp.fc2", "value": "inf"}
    m, steps, out = run(tmp_path, {"policy": "dynamic", "init_scale": 1024, "growth_interval": 100},
                        faults=FAULTS + [fwd])
    located = {r.step: (r.forward_overflow_module, r.forward_overflow_type, r.forward_amax)
               for r in steps.itertuples() if r.forward_overflow_module}
    assert list(located) == [3]
    module, kind, amax = located[3]
    # the first in forward order: fc2 itself, before the block, the blocks and the model that contain it
    assert module == "blocks.0.mlp.fc2" and kind == "Linear" and float(amax) == math.inf
    assert set(steps.found_inf[steps.found_inf == 1].index) == {2, 3, 5, 6}
    d = diagnose(out)
    f = next(f for f in d.findings if f.code == "forward_overflow")
    assert f.evidence["module"] == "blocks.0.mlp.fc2" and f.evidence["steps"] == 1
    rec = next(r for r in d.recommendations if r.code == "keep_fp32")
    assert "Keep blocks.0.mlp.fc2 (Linear) in FP32" in rec.action

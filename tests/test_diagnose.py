"""`python -m lab diagnose`: explanations of real tiny runs made to overflow, collapse the scale, oscillate,
underflow, fall back to FP32 or stay healthy, and clear errors for broken run directories.

The underflow cases replace a real run's census.csv with crafted rows in the documented format (step, scale,
source, layer, at_scale, total, zero, underflow, subnormal, normal, overflow); likewise some tests rewrite
steps.csv's first_nonfinite_layer / first_nonfinite_source columns.
"""
import contextlib
import copy
import csv
import io
import json
import math
import re
import shutil
import types

import pytest

from lab import cli as lab_cli
from lab.core.config import resolve_run, validate_study
from lab.diagnose import DiagnoseError, diagnose, fmt_scale, format_text
from lab.run.train import train

from conftest import tiny_study

# name -> (model, mode definition, train overrides): real configurations that produce each condition
CASES = {
    # every backward pass overflows FP16 at 2^40: all steps skipped, status diverged
    "static-huge": ("resnet50", {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}},
                    dict(max_steps=4)),
    # GradScaler's rule from 2^60: 45 halvings before the first clean step at 2^15, then it trains
    "dynamic-init60": ("resnet50", {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0 ** 60}},
                       dict(max_steps=60, epochs=2)),
    # lr 1e6: one applied update pushes weights past 65504, the FP16 forward gives NaN, the scale halves to 2^-7
    "dynamic-lr1e6": ("resnet50", {"precision": "fp16", "scaler": {"policy": "dynamic"}},
                      dict(lr=1e6, schedule="constant", max_steps=24)),
    # the same with the FP32 fallback guard: the loss stays NaN in FP32 too
    "fallback-lr1e6": ("resnet50", {"precision": "fp16", "scaler": {"policy": "dynamic", "fp32_fallback_after": 5}},
                       dict(lr=1e6, schedule="constant", max_steps=12)),
    # growth every clean step: the scale grows into an overflow, halves, grows again
    "dynamic-growth1": ("vit", {"precision": "fp16", "scaler": {"policy": "dynamic", "growth_interval": 1}},
                        dict(max_steps=30)),
    "fp16-noscale": ("resnet50", {"precision": "fp16", "scaler": {"policy": "none"}}, dict(max_steps=3)),
    "fp16-static128": ("resnet50", {"precision": "fp16", "scaler": {"policy": "static", "scale": 128}},
                       dict(max_steps=3)),
    "fp32": ("resnet50", {"precision": "fp32"}, dict(max_steps=3)),
}
CENSUS_FIELDS = ["step", "scale", "source", "layer", "at_scale", "total", "zero", "underflow", "subnormal",
                 "normal", "overflow"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trains each case once, on first use; returns a function name -> a fresh copy of its run directory."""
    base = tmp_path_factory.mktemp("diagnose-runs")
    done = {}

    def get(name, copy_to=None):
        if name not in done:
            model, mode_def, overrides = CASES[name]
            study = copy.deepcopy(tiny_study())
            study["modes"][name] = mode_def
            study["train"].update(overrides)
            cfg = resolve_run(validate_study(study), model, name, 0)
            done[name] = base / name
            train(cfg, done[name], progress=io.StringIO())
        if copy_to is None:
            return done[name]
        shutil.copytree(done[name], copy_to)
        return copy_to
    return get


def write_steps(run, rows) -> None:
    """Rewrite a run's steps.csv with crafted rows (same columns as the rows carry)."""
    with open(run / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def codes(d, kind="findings"):
    return [x.code for x in getattr(d, kind)]


def finding(d, code):
    return next(f for f in d.findings if f.code == code)


def write_census(run_dir, rows):
    with open(run_dir / "census.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CENSUS_FIELDS)
        w.writerows(rows)


def cli(*args):
    """`python -m lab diagnose ARGS` in this process (lab.cli.main, what lab/__main__.py calls; a subprocess per
    call cost ~4 s of importing torch): its exit status, stdout and stderr. An exception that escapes the command
    (a traceback, in a process of its own) fails the test here."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = lab_cli.main(["diagnose", *map(str, args)])
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


# --- overflow ---------------------------------------------------------------------------------------------
def test_static_scale_that_always_overflows(runs):
    d = diagnose(runs("static-huge"))
    assert d.verdict == "diverged" and d.status == "diverged"
    assert (d.steps, d.overflow_steps, d.skipped_steps, d.first_overflow_step) == (4, 4, 4, 0)
    assert d.skip_rate == 1.0 and d.update_ratio == 0.0
    assert d.longest_skip_streak == 4 and d.longest_skip_streak_start == 0
    assert d.init_scale == d.final_scale == 2.0 ** 40 and d.scale_halvings == 0
    f = finding(d, "init_scale_too_high")
    assert f.severity == "problem" and "2^40" in f.message
    assert codes(d, "recommendations")[0] == "lower_scale"   # a static policy has no init_scale to lower
    assert "scale_collapse" not in codes(d)                  # nothing moved: not a collapse
    text = format_text(d)
    assert "every optimizer step was skipped" in text and "4 of 4" in text


def test_first_nonfinite_layer_names_the_responsible_layer(runs, tmp_path):
    run = runs("static-huge", tmp_path / "run")
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    layers = ["head.fc", "head.fc", "stages.3.0.conv3", "head.fc"]
    sources = ["activation_grad", "activation_grad", "param_grad", "activation_grad"]
    for row, layer, source in zip(rows, layers, sources):
        row["first_nonfinite_layer"], row["first_nonfinite_source"] = layer, source
    write_steps(run, rows)
    d = diagnose(run)
    assert d.overflow_layers == {"head.fc (activation_grad)": 3, "stages.3.0.conv3 (param_grad)": 1}
    assert "head.fc (activation_grad) on 3 of 4 overflow steps" in finding(d, "overflow_layers").message
    for row in rows:  # steps.csv of earlier versions: the layer alone
        del row["first_nonfinite_source"]
    write_steps(run, rows)
    assert diagnose(run).overflow_layers == {"head.fc": 3, "stages.3.0.conv3": 1}
    assert not any("first_nonfinite_layer" in n for n in d.notes)
    # as the training loop writes it: the column, with the layer attribution found on each overflow step
    plain = diagnose(runs("static-huge"))
    with open(runs("static-huge") / "steps.csv") as f:
        written = list(csv.DictReader(f))
    assert all(r["first_nonfinite_layer"] for r in written)
    assert sum(plain.overflow_layers.values()) == 4 and not any("first_nonfinite_layer" in n for n in plain.notes)


def later_overflows(rows) -> list[dict]:
    """steps.csv rows with an overflow after the first clean step (what diagnose reports apart)."""
    first_clean = next(i for i, r in enumerate(rows) if r["found_inf"] == "0")
    return [r for r in rows[first_clean:] if r["found_inf"] == "1"]


def test_overflow_layers_after_the_calibration_streak(runs, tmp_path):
    """Where overflows start once the scale has calibrated is reported apart from the initial streak."""
    run = runs("dynamic-init60", tmp_path / "run")
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    d0 = diagnose(run)
    later = later_overflows(rows)
    first_clean = next(r for r in rows if r["found_inf"] == "0")
    # GradScaler's rule from 2^60: one halving per overflow down to the first scale that works on this model
    assert d0.initial_overflow_streak == 60 - int(math.log2(float(first_clean["scale"]))) == int(first_clean["step"])
    assert sum(d0.later_overflow_layers.values()) == len(later)
    for row in later:  # a clean baseline after the streak, then two later overflow steps planted
        row.update(found_inf="0", skipped="0", first_nonfinite_layer="", first_nonfinite_source="")
    write_steps(run, rows)
    d_clean = diagnose(run)
    assert d_clean.later_overflow_layers == {}
    assert "after the first clean step" not in finding(d_clean, "overflow_layers").message
    for row in rows[50:52]:  # two later overflow steps, as a growth probe would make them
        row.update(found_inf="1", skipped="1", first_nonfinite_layer="conv1", first_nonfinite_source="param_grad")
    write_steps(run, rows)
    d = diagnose(run)
    assert d.later_overflow_layers == {"conv1 (param_grad)": 2}
    assert d.overflow_layers["conv1 (param_grad)"] == d_clean.overflow_layers.get("conv1 (param_grad)", 0) + 2
    f = finding(d, "overflow_layers")
    assert f"after the first clean step (step {d0.initial_overflow_streak}): conv1 (param_grad) on 2 of 2" in f.message
    assert f.evidence["later_layers"] == {"conv1 (param_grad)": 2}


def test_high_init_scale_is_a_calibration_streak_not_a_collapse(runs):
    d = diagnose(runs("dynamic-init60"))     # measured: 45 overflows, first clean step at 2^15
    with open(runs("dynamic-init60") / "steps.csv") as f:
        later = len(later_overflows(list(csv.DictReader(f))))  # each halves the scale once more
    assert d.status == "ok" and d.verdict == "issues"
    f = finding(d, "init_scale_too_high")
    working = f.evidence["first_working_scale"]
    assert 2.0 ** 10 <= working <= 2.0 ** 16
    streak = 60 - int(math.log2(working))     # one halving per overflow from 2^60 down to the working scale
    assert d.initial_overflow_streak == d.longest_skip_streak == streak and d.first_overflow_step == 0
    assert d.init_scale == 2.0 ** 60 and d.final_scale == working / 2 ** later
    assert d.scale_halvings == streak + later
    assert f.severity == "problem"            # more than half of the 60 steps were lost
    assert "scale_collapse" not in codes(d) and "loss_nonfinite" not in codes(d)
    rec = d.recommendations[0]
    assert rec.code == "lower_init_scale" and f"2^{60 - streak} = {int(working)}" in rec.action
    assert "bf16" not in codes(d, "recommendations")


# --- scale collapse and a non-finite loss -------------------------------------------------------------------
def test_scale_collapse_from_a_nan_forward_pass(runs):
    d = diagnose(runs("dynamic-lr1e6"))     # measured: NaN loss from step 2 on, scale 2^16 -> 2^-7
    assert d.verdict == "diverged"
    first = d.first_nonfinite_loss_step
    assert 1 <= first <= 3 and d.nonfinite_loss_steps == 24 - first      # NaN from then on, to the end
    assert d.init_scale == 2.0 ** 16 and d.final_scale <= 2.0 ** -4 and d.min_scale == d.final_scale
    f = finding(d, "scale_collapse")
    assert f.severity == "problem" and "<= 1" in f.message and fmt_scale(d.final_scale) in f.message
    assert "no loss scale can prevent it" in finding(d, "loss_nonfinite").message
    recs = codes(d, "recommendations")
    assert recs[0] == "lower_lr" and "1e+06" in d.recommendations[0].action
    assert "keep_fp32" in recs and "lower_init_scale" not in recs   # the replay located the forward's module
    assert d.headline.startswith("diverged (final training loss is not finite)")


def test_fp32_fallback_that_does_not_help_points_at_the_learning_rate(runs, tmp_path):
    """A real run at lr 1e6 falls back to FP32 within 11 steps; whether its FP32 steps then go NaN depends on the
    kernels' last bits (on AVX2 and AVX-512 4 of 5 did; under ATen's default kernels none), so the FP32 steps'
    losses are made NaN here, as they were measured, and the diagnosis of that run is what is tested."""
    run = runs("fallback-lr1e6", tmp_path / "run")
    fell_back = diagnose(run).fallback_step
    assert fell_back is not None and fell_back < 11
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    for i, row in enumerate(rows):
        if i > fell_back and i % 5:  # NaN on 4 of the 5 FP32 steps, as measured
            row["loss"] = "nan"
    write_steps(run, rows)
    d = diagnose(run)
    assert d.fallback_step == fell_back
    # the FP16 scale when it gave up, not the 1.0 the fallback sets
    assert d.final_scale == float(rows[d.fallback_step]["scale"]) > 1
    assert finding(d, "fp32_fallback").evidence["fp32_steps"] == 12 - d.fallback_step - 1
    assert finding(d, "loss_nonfinite").evidence["after_fallback"] >= 1
    assert codes(d, "recommendations") == ["lower_lr"]
    assert "precision is not the cause" in d.recommendations[0].evidence


def test_growth_every_step_oscillates(runs):
    d = diagnose(runs("dynamic-growth1"))
    f = finding(d, "growth_oscillation")
    assert f.evidence["overflows_after_growth"] >= 3 and "growth_interval 1" in f.message
    assert d.update_ratio < 0.95 and d.verdict == "issues"
    assert codes(d, "recommendations")[0] == "longer_growth_interval"


def test_runaway_scale(runs, tmp_path):
    # crafted from a real run: the scale doubles every step to 2^30 (what a scale with no overflow to stop it does)
    run = runs("fp16-static128", tmp_path / "run")
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    for i, row in enumerate(rows):
        row["scale"] = repr(2.0 ** (16 + 7 * i))
    write_steps(run, rows)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["final_scale"] = 2.0 ** 37
    (run / "metrics.json").write_text(json.dumps(metrics))
    d = diagnose(run)
    assert finding(d, "scale_runaway").evidence["max_scale"] == 2.0 ** 37
    assert "cap_scale" in codes(d, "recommendations") and d.verdict == "issues"


# --- underflow (census.csv) ---------------------------------------------------------------------------------
def test_fp16_census_without_its_replay_is_unknown_underflow_not_zero(runs, tmp_path):
    """An FP16 run's own census cannot tell a flushed value from a true zero (reading it as 0.0% would call
    the run "healthy, nothing to change"). With 40% zeros: underflow unknown, and said so; all zero: flushed, a problem."""
    run = runs("fp16-noscale", tmp_path / "run")
    write_census(run, [
        [2, 1, "activation_grad", "__total__", 1, 100000, 40000, 0, 3000, 57000, 0],
        [2, 1, "param_grad", "__total__", 1, 20000, 1000, 0, 200, 18800, 0],
    ])
    d = diagnose(run)
    assert d.underflow_at_final_scale is None
    f = finding(d, "underflow_unknown")
    assert f.severity == "info" and "40.0% exactly zero" in f.message and not re.search(r"(?<![0-9])0\.0%", f.message)
    assert "underflow not measured" in d.recommendations[0].evidence
    write_census(run, [
        [2, 1, "activation_grad", "__total__", 1, 100000, 100000, 0, 0, 0, 0],
        [2, 1, "param_grad", "__total__", 1, 20000, 19990, 0, 10, 0, 0],
    ])
    d = diagnose(run)
    f = finding(d, "grads_flushed")
    assert f.severity == "problem" and d.verdict == "issues" and "100.0% exactly zero" in f.message
    assert f.evidence["no_normal"] == ["param_grad"]
    assert codes(d, "recommendations")[:2] == ["raise_scale", "measure_underflow"]
    assert "no step overflowed" in d.recommendations[0].evidence


def _counterfactual(underflow_at, overflow_at=None):
    rows = []
    for at, uf in underflow_at.items():
        ov = (overflow_at or {}).get(at, 0)
        rows.append([2, 1, "activation_grad", "__total__", at, 100000, 30000, int(uf * 100000), 500, 69500 - ov, ov])
        rows.append([2, 1, "param_grad", "__total__", at, 20000, 0, int(uf * 2000), 0, 20000, 0])
    return rows


def test_fp32_counterfactual_census_picks_a_scale(runs, tmp_path):
    run = runs("fp32", tmp_path / "run")
    write_census(run, _counterfactual({1: 0.12, 128: 0.03, 1024: 0.004, 65536: 0.0005}, {65536: 20}))
    d = diagnose(run)
    assert d.verdict == "healthy"                    # an FP32 run is not hurt by FP16's range ...
    assert codes(d, "recommendations") == ["healthy", "raise_scale"]   # ... but FP16 would need a scale
    assert "1024" in d.recommendations[1].action and "nothing overflows" in d.recommendations[1].evidence
    assert d.census["table"]["activation_grad"]["65536"]["overflow"] == 20


def test_underflow_at_every_scale_recommends_bf16(runs, tmp_path):
    run = runs("fp32", tmp_path / "run")
    write_census(run, _counterfactual({1: 0.40, 128: 0.25, 1024: 0.15, 65536: 0.05}))
    d = diagnose(run)
    assert "no_fp16_scale_fits" in codes(d) and "bf16" in codes(d, "recommendations")
    assert "raise_scale" not in codes(d, "recommendations")


# --- healthy ------------------------------------------------------------------------------------------------
def test_healthy_run(runs, tmp_path):
    run = runs("fp16-static128", tmp_path / "run")
    (run / "census.csv").unlink(missing_ok=True)    # underflow has its own tests
    d = diagnose(run)
    assert d.verdict == "healthy" and d.healthy
    assert d.update_ratio == 1.0 and d.overflow_steps == 0 and d.init_scale == d.final_scale == 128
    assert not [f for f in d.findings if f.severity != "info"]
    assert codes(d, "recommendations") == ["healthy"]
    assert diagnose(runs("fp32")).verdict == "healthy"


# --- the command line ---------------------------------------------------------------------------------------
def strict_json(text):
    """json.loads that refuses the bare NaN / Infinity which Python's json writes and accepts by default."""
    def refuse(name):
        raise ValueError(f"bare {name} in the JSON output")
    return json.loads(text, parse_constant=refuse)


def test_cli_text_and_json(runs, tmp_path):
    run = runs("dynamic-lr1e6", tmp_path / "run")
    text = cli(run)
    assert text.returncode == 0, text.stderr
    assert "Verdict: diverged" in text.stdout and "Lower the learning rate" in text.stdout
    with open(run / "steps.csv") as f:  # a scale that ran to inf: a non-finite number in the diagnosis
        rows = list(csv.DictReader(f))
    rows[-1]["scale"] = "inf"
    write_steps(run, rows)
    d = diagnose(run)
    assert d.max_scale == math.inf
    js = cli(run, "--json")
    assert js.returncode == 0, js.stderr
    data = strict_json(js.stdout)     # strict JSON: non-finite numbers are strings
    assert data["max_scale"] == "inf"
    assert data["verdict"] == "diverged" and data["final_scale"] == d.final_scale <= 2.0 ** -4
    assert [f["code"] for f in data["findings"]] == codes(d)
    assert data["recommendations"][0]["code"] == "lower_lr"


@pytest.mark.parametrize("breakage", ["no-dir", "no-metrics", "bad-json", "no-steps", "steps-missing-column",
                                      "steps-bad-value", "census-missing-column"])
def test_broken_run_directories_exit_2_naming_the_path(runs, tmp_path, breakage):
    run = runs("fp16-static128", tmp_path / "run")
    bad = {"no-dir": tmp_path / "nope", "no-metrics": run / "metrics.json", "bad-json": run / "metrics.json",
           "no-steps": run / "steps.csv", "steps-missing-column": run / "steps.csv",
           "steps-bad-value": run / "steps.csv", "census-missing-column": run / "census.csv"}[breakage]
    target = tmp_path / "nope" if breakage == "no-dir" else run
    if breakage in ("no-metrics", "no-steps"):
        bad.unlink()
    elif breakage == "bad-json":
        bad.write_text('{"status": "ok", ')
    elif breakage == "steps-missing-column":
        bad.write_text("step,epoch,loss,found_inf\n0,0,2.3,0\n")
    elif breakage == "steps-bad-value":
        lines = bad.read_text().splitlines()
        lines[2] = lines[2].replace(lines[2].split(",")[3], "big", 1)     # the scale column of step 1
        bad.write_text("\n".join(lines) + "\n")
    elif breakage == "census-missing-column":
        bad.write_text("step,scale,source,layer\n0,1,activation_grad,__total__\n")
    with pytest.raises(DiagnoseError) as err:
        diagnose(target)
    assert str(bad) in str(err.value)
    res = cli(target)
    assert res.returncode == 2 and str(bad) in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    if breakage == "steps-missing-column":
        assert "scale, skipped" in res.stderr
    if breakage == "steps-bad-value":
        assert "line 3" in res.stderr and "'big'" in res.stderr


def test_fmt_scale():
    assert [fmt_scale(x) for x in (2.0 ** 16, 1024.0, 1.0, 2.0 ** -7, 3000.0, math.inf, None)] == \
        ["2^16", "1024", "1", "2^-7", "3000", "inf", "n/a"]


def test_replay_does_not_offer_a_policy_it_cannot_judge(runs, tmp_path):
    """GradScaler's rule from 2^60 skips its way down. Replayed over the run's gradients, amax-history (which starts
    at 1024) would skip none of those steps, but each of them overflowed at a scale above 1024, so whether 1024
    overflows there is unknown: uncertain on most steps, it is not offered (docs/diagnose.md, rule 2)."""
    from lab.diagnose.replay import replay_run
    run = runs("dynamic-init60", tmp_path / "run")
    d = diagnose(run)
    amax = next(r for r in replay_run(run) if r["policy"] == "amax-history")
    assert amax["skipped_steps"] < d.skipped_steps and 2 * amax["uncertain_steps"] > amax["steps"]
    rows = {r["policy"]: r for r in replay_run(run)}
    for rec in d.recommendations:   # whatever is offered was judged on most steps
        if rec.code == "replay_policy":
            r = rows[rec.change["policy"]]
            assert r["skipped_steps"] + r["uncertain_steps"] < d.skipped_steps
            assert r["overflow_steps"] <= r["skipped_steps"]
    assert any("amax-history" in n and "uncertain" in n for n in d.notes)
    assert all("amax-history" not in r.action for r in d.recommendations)

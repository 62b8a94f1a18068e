"""The diagnose findings docs/diagnose.md promises, each on a synthetic run directory built to show it (and absent
from a healthy one): isolated overflow spikes and the hysteresis recommendation, the FP32-fallback recommendation,
a run that is not learning, a low update ratio without overflow, and overflow at a scale <= 1.

The run directories hold what a real run writes (metrics.json, steps.csv with the training loop's columns,
config.yaml with the resolved mode and train blocks); no census.csv (not needed by these rules) and no grad_amax
column (nothing to replay). Every expectation is computed here from the rows the test wrote.
"""
import csv
import json
import math

import pytest
import yaml

from lab.diagnose import HEALTHY_UPDATE_RATIO, diagnose

STEP_FIELDS = ["step", "epoch", "loss", "scale", "found_inf", "skipped", "grad_norm", "lr", "precision",
               "first_nonfinite_layer", "first_nonfinite_source"]


def write_run(run_dir, scales, found_inf, *, skipped=None, loss=None, precision="fp16", policy="dynamic",
              scaler=None, final_scale=None, lr=3e-3):
    """A run directory with one steps.csv row per entry of `scales` (the scale each step used)."""
    n = len(scales)
    skipped = list(found_inf) if skipped is None else skipped
    loss = [2.3 * math.exp(-i / (n / 3)) + 0.1 for i in range(n)] if loss is None else loss
    run_dir.mkdir(parents=True)
    with open(run_dir / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=STEP_FIELDS, lineterminator="\n")
        w.writeheader()
        for i in range(n):
            w.writerow(dict(step=i, epoch=0, loss=loss[i], scale=scales[i], found_inf=int(found_inf[i]),
                            skipped=int(skipped[i]), grad_norm="inf" if found_inf[i] else 1.0, lr=lr,
                            precision=precision, first_nonfinite_layer="", first_nonfinite_source=""))
    mode = {"name": "m", "precision": precision}
    if precision == "fp16":
        mode["scaler"] = {"policy": policy, **(scaler or {})}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"family": "resnet50"}, "mode": mode, "seed": 0, "train": {"lr": lr, "schedule": "constant"}}))
    metrics = dict(model="resnet50", mode="m", seed=0, precision=precision,
                   scaler=policy if precision == "fp16" else "none", status="ok", steps=n,
                   overflow_steps=sum(map(bool, found_inf)), skipped_steps=sum(map(bool, skipped)),
                   final_scale=scales[-1] if final_scale is None else final_scale, diverged=False,
                   fallback_step=None)
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    return run_dir


def spiky_scales(n, spikes, start=2.0 ** 16):
    """A dynamic scale that halves after each step in `spikes` (no growth): the scales used and the final one."""
    scales, s = [], start
    for i in range(n):
        scales.append(s)
        if i in spikes:
            s /= 2
    return scales, s


def codes(items):
    return [x.code for x in items]


def get(items, code):
    return next(x for x in items if x.code == code)


# --- a healthy run: none of the findings below --------------------------------------------------------------
def test_a_healthy_run_has_none_of_these_findings(tmp_path):
    n = 200
    d = diagnose(write_run(tmp_path / "run", [2.0 ** 16] * n, [False] * n))
    assert d.verdict == "healthy"
    assert not {"isolated_spikes", "not_learning", "low_update_ratio", "overflow_at_low_scale", "scale_collapse",
                "overflow"} & set(codes(d.findings))
    assert codes(d.recommendations) == ["healthy"]
    assert get(d.findings, "loss_trend").severity == "info"


# --- isolated overflow spikes, and hysteresis -------------------------------------------------------------
@pytest.mark.parametrize("policy", ["dynamic", "hysteresis"])
def test_isolated_spikes_recommend_hysteresis(tmp_path, policy):
    n, spikes = 200, [50, 100, 150]
    scales, final = spiky_scales(n, spikes)
    found = [i in spikes for i in range(n)]
    scaler = {"hysteresis": 2} if policy == "hysteresis" else {}
    d = diagnose(write_run(tmp_path / "run", scales, found, policy=policy, scaler=scaler, final_scale=final))
    f = get(d.findings, "isolated_spikes")
    assert f.severity == "warning"
    assert f.evidence == {"spikes": 3, "from_scale": 2.0 ** 16, "to_scale": 2.0 ** 13}
    assert "steps 50, 100, 150" in f.message
    rec = get(d.recommendations, "hysteresis")
    assert rec.based_on == ["isolated_spikes"]
    if policy == "hysteresis":   # already hysteresis: raise it (Megatron's tracker refills only on growth)
        assert "Raise hysteresis above 2" in rec.action
    else:
        assert rec.action.startswith("Use hysteresis")
    assert "growth_oscillation" not in codes(d.findings)  # the scale never grew into these overflows
    assert d.verdict == "issues"  # a warning: not healthy, though 98.5 % of the steps updated the weights


def test_two_spikes_are_info_without_a_recommendation_and_one_is_no_finding(tmp_path):
    n = 200
    for name, spikes in (("two", [60, 140]), ("one", [100])):
        scales, final = spiky_scales(n, spikes)
        d = diagnose(write_run(tmp_path / name, scales, [i in spikes for i in range(n)], final_scale=final))
        if len(spikes) == 2:
            assert get(d.findings, "isolated_spikes").severity == "info"
        else:
            assert "isolated_spikes" not in codes(d.findings)
        assert "hysteresis" not in codes(d.recommendations)


# --- the scale collapses: bf16, and the FP32 fallback unless it is on ---------------------------------------
@pytest.mark.parametrize("fallback_on", [False, True])
def test_collapse_recommends_the_fp32_fallback_unless_configured(tmp_path, fallback_on):
    n, clean = 40, 10
    found = [i >= clean for i in range(n)]             # 10 clean steps at 2^16, then an overflow on every step
    scales, final = spiky_scales(n, [i for i in range(n) if found[i]])
    assert min(scales) < 1
    scaler = {"fp32_fallback_after": 100} if fallback_on else {}
    d = diagnose(write_run(tmp_path / "run", scales, found, scaler=scaler, final_scale=final))
    collapse = get(d.findings, "scale_collapse")
    assert collapse.severity == "problem" and collapse.evidence["halvings"] == n - clean
    assert "bf16" in codes(d.recommendations)
    if fallback_on:
        assert "fp32_fallback" not in codes(d.recommendations)
    else:
        rec = get(d.recommendations, "fp32_fallback")
        assert "fp32_fallback_after" in rec.action and rec.based_on == ["scale_collapse"]
        assert f"{n - clean} times" in rec.evidence


# --- overflow at a scale <= 1 -----------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.5, 128.0])
def test_overflow_at_a_low_static_scale(tmp_path, scale):
    n, over = 50, [10, 20, 30]
    d = diagnose(write_run(tmp_path / "run", [scale] * n, [i in over for i in range(n)], policy="static",
                           scaler={"scale": scale}))
    if scale > 1:
        assert "overflow_at_low_scale" not in codes(d.findings)
        assert not {"bf16", "fp32_fallback"} & set(codes(d.recommendations))
        return
    f = get(d.findings, "overflow_at_low_scale")
    assert f.evidence == {"steps": 3} and "first at step 10" in f.message
    assert f.severity == "problem"            # 3 >= 5 % of 50 steps
    assert get(d.recommendations, "bf16").based_on == ["overflow_at_low_scale"]
    assert get(d.recommendations, "fp32_fallback").based_on == ["overflow_at_low_scale"]


def test_one_overflow_at_scale_one_is_a_warning(tmp_path):
    n = 100
    d = diagnose(write_run(tmp_path / "run", [1.0] * n, [i == 40 for i in range(n)], policy="static",
                           scaler={"scale": 1.0}))
    assert get(d.findings, "overflow_at_low_scale").severity == "warning"


# --- not learning -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["flat", "rising", "falling"])
def test_not_learning(tmp_path, shape):
    n = 120
    loss = {"flat": [2.3] * n, "rising": [2.0 + 0.01 * i for i in range(n)],
            "falling": [2.3 - 0.01 * i for i in range(n)]}[shape]
    d = diagnose(write_run(tmp_path / "run", [2.0 ** 16] * n, [False] * n, loss=loss))
    k = n // 10
    first, last = sum(loss[:k]) / k, sum(loss[-k:]) / k
    if shape == "falling":
        assert "not_learning" not in codes(d.findings) and d.verdict == "healthy"
        return
    f = get(d.findings, "not_learning")
    assert f.severity == "warning" and d.verdict == "issues"
    assert f.evidence == pytest.approx({"first": first, "last": last})
    assert f"over {n} applied steps" in f.message


def test_not_learning_needs_a_hundred_applied_steps(tmp_path):
    n = 99   # a flat loss over too few applied steps is no evidence
    d = diagnose(write_run(tmp_path / "run", [2.0 ** 16] * n, [False] * n, loss=[2.3] * n))
    assert "not_learning" not in codes(d.findings) and "loss_trend" in codes(d.findings)


# --- a low update ratio without overflow ------------------------------------------------------------------
@pytest.mark.parametrize("skips, healthy", [(10, False), (6, False), (5, False), (4, True)])
def test_low_update_ratio_without_overflow(tmp_path, skips, healthy):
    """The source study's rule, written here rather than read from the code: healthy when more than 95% of the
    steps were applied (90%, 94% and exactly 95% are not; 96% is)."""
    n = 100
    skipped = [i % (n // skips) == 5 for i in range(n)]
    assert sum(skipped) == skips
    d = diagnose(write_run(tmp_path / "run", [1.0] * n, [False] * n, skipped=skipped, precision="fp32"))
    ratio = (n - skips) / n
    assert d.update_ratio == pytest.approx(ratio) and "overflow" not in codes(d.findings)
    assert HEALTHY_UPDATE_RATIO == 0.95
    if healthy:
        assert "low_update_ratio" not in codes(d.findings) and d.verdict == "healthy"
    else:
        f = get(d.findings, "low_update_ratio")
        assert f.severity == "warning" and f.evidence["update_ratio"] == pytest.approx(ratio)
        assert d.verdict == "issues"


# --- replay_policy: only where a loss scale could help, and only at no more than 0.1 points more flushed ----------
def _replay_rules(monkeypatch, rows, **fields):
    import lab.diagnose.replay as replay_mod
    from lab.diagnose.advice import replay_findings as _replay_findings
    from lab.diagnose.record import Diagnosis, _Builder
    monkeypatch.setattr(replay_mod, "replay_run", lambda run_dir: rows)
    d = Diagnosis(run_dir="x", verdict="", headline="", precision="fp16", policy="dynamic", final_scale=1.0)
    d.skipped_steps = 5
    for k, v in fields.items():
        setattr(d, k, v)
    b = _Builder()
    _replay_findings(b, d, "x")
    return [r.code for r in b.recs]


def _row(policy, skipped, flushed):
    return {"policy": policy, "skipped_steps": skipped, "flushed_param": flushed, "ended_at": None}


@pytest.mark.parametrize("extra, offered", [(0.0009, True), (0.0011, False)])
def test_replay_policy_allows_at_most_a_tenth_of_a_point_more_flushed(monkeypatch, extra, offered):
    rows = [_row("dynamic", 5, 0.002), _row("amax-history", 0, 0.002 + extra)]
    assert ("replay_policy" in _replay_rules(monkeypatch, rows)) == offered


@pytest.mark.parametrize("fields", [{"nonfinite_loss_steps": 2}, {"fallback_step": 7}])
def test_replay_policy_is_not_offered_after_a_nonfinite_loss_or_an_fp32_fallback(monkeypatch, fields):
    rows = [_row("dynamic", 5, 0.002), _row("amax-history", 0, 0.002)]
    assert "replay_policy" in _replay_rules(monkeypatch, rows)  # the same rows do offer it otherwise
    assert "replay_policy" not in _replay_rules(monkeypatch, rows, **fields)


# --- findings and recommendations docs/diagnose.md names ---------------------------------------------------------
def test_a_run_without_a_step_is_a_problem(tmp_path):
    d = diagnose(write_run(tmp_path / "run", [], [], final_scale=1.0))
    f = get(d.findings, "no_steps")
    assert f.severity == "problem" and d.verdict != "healthy"


def test_deepspeed_ending_at_its_floor_recommends_a_lower_min_scale(tmp_path):
    from lab.scaling.policies.deepspeed import DEEPSPEED_FLOOR_MESSAGE
    run = write_run(tmp_path / "run", [1.0] * 10, [False] * 9 + [True], policy="deepspeed")
    m = json.loads((run / "metrics.json").read_text())
    m.update(status="diverged", diverged=True, diverged_reason=f"{DEEPSPEED_FLOOR_MESSAGE} (loss scale 1)")
    (run / "metrics.json").write_text(json.dumps(m))
    d = diagnose(run)
    assert "diverged" in codes(d.findings)
    rec = next(r for r in d.recommendations if r.code == "lower_min_scale")
    assert rec.based_on == ["diverged"]


def test_amax_history_overflowing_right_after_each_rise_recommends_a_larger_margin(tmp_path):
    # the scale rises to what the recent maxima allow and the very next step overflows, four times over
    scales = [1024.0, 2048.0] * 4 + [1024.0] * 4
    found = [False, True] * 4 + [False] * 4
    d = diagnose(write_run(tmp_path / "run", scales, found, policy="amax-history", scaler={"margin": 3}))
    assert "growth_oscillation" in codes(d.findings)
    rec = next(r for r in d.recommendations if r.code == "larger_margin")
    assert "Raise margin above 3" in rec.action


# --- the rules of advice (docs/diagnose.md): what the run's own evidence contradicts ------------------------------
def test_advice_the_evidence_contradicts_is_named():
    from lab.diagnose.advice import contradiction
    from lab.diagnose.record import Diagnosis, Finding, Recommendation, _Step
    rows = [_Step(step=i, loss=1.0, scale=s, found_inf=f, skipped=f, precision="fp16", lr=None, layer=None)
            for i, (s, f) in enumerate([(2.0 ** 16, True), (2.0 ** 15, False), (2.0 ** 15, True), (2.0 ** 14, False)])]
    d = Diagnosis(run_dir="x", verdict="", headline="", precision="fp16", policy="dynamic")
    d.initial_overflow_streak = 1

    def why(cfg=None, nonfinite=None, **change):
        return contradiction(Recommendation("x", "do it", "because", [], change), d, rows, cfg or {}, nonfinite)
    assert "already used policy dynamic" in why(policy="dynamic") and why(policy="hysteresis") is None
    assert "overflowed at 2^15" in why(scale=2.0 ** 15) and why(scale=2.0 ** 14) is None
    # an initial scale only where the start overflowed: 2^15 overflowed later, in training, not at the start
    assert why(init_scale=2.0 ** 15) is None and "overflowed at 2^16" in why(init_scale=2.0 ** 16)
    assert "no room" in why(scale_above=2.0 ** 14) and why(scale_above=2.0 ** 16) is None
    assert why(precision="bf16") is None and why(fp32_fallback_after=10) is None
    assert "already had fp32_fallback_after" in why({"fp32_fallback_after": 10}, fp32_fallback_after=10)
    diverging = Finding("loss_nonfinite", "problem", "", {"diverging": True, "after_fallback": 0})
    assert "a divergence" in why(None, diverging, precision="bf16")
    assert "FP32 too" in why(None, Finding("loss_nonfinite", "problem", "", {"after_fallback": 3}), precision="bf16")
    d.policy = "torch.amp.GradScaler"   # a recording under GradScaler: its rule is dynamic's
    assert "already used" in why(policy="dynamic")
    d.precision = "bf16"
    assert "already trained in bf16" in why(precision="bf16")

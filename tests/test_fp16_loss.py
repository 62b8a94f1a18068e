"""What FP16 lost, measured in the FP16 run itself: each census step replayed in FP32 (lab/numerics/monitor.py
census_fp32_replay), its rows in census.csv (grads "fp32"), the run's flushed shares, and `lab diagnose` reading
them (lab/diagnose/underflow.py fp16_loss_findings)."""
import csv

import pytest

from lab.core.config import resolve_run, validate_study
from lab.diagnose import diagnose
from lab.run.train import train

from conftest import tiny_study

LM_DATA = {"name": "pydoc", "context": 16, "vocab_size": 256, "val_fraction": 0.1}


def run(tmp_path, name, mode_def, model="lm", steps=8, **overrides):
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny", "data": LM_DATA}, "resnet50": {"preset": "resnet50-digits"}}
    study["modes"] = {"m": mode_def}
    study["train"].update(epochs=3, max_steps=steps, batch_size=16, census_every=3, log_every=1, **overrides)
    cfg = resolve_run(validate_study(study), model, "m", 0)
    out = tmp_path / name
    return train(cfg, out), out


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def fp16(policy="none", **params):
    return {"precision": "fp16", "scaler": {"policy": policy, **params}}


@pytest.mark.parametrize("model", ["lm", "resnet50"])  # resnet50: BatchNorm statistics must be restored
def test_the_replay_leaves_the_run_bit_identical(tmp_path, model):
    m_on, on = run(tmp_path, "on", fp16("static", scale=128), model=model)
    m_off, off = run(tmp_path, "off", fp16("static", scale=128), model=model, census_fp32_replay=False)
    assert (on / "steps.csv").read_bytes() == (off / "steps.csv").read_bytes()
    own = [r for r in rows(on / "census.csv") if r["grads"] == "fp16"]
    assert own == rows(off / "census.csv")  # the step's own FP16 census is untouched
    assert m_on["final_val_loss"] == m_off["final_val_loss"]
    assert m_on["census_fp32_replays"] == m_on["census_steps"] == 3 and m_off["census_fp32_replays"] == 0
    assert {r["grads"] for r in rows(on / "census.csv")} == {"fp16", "fp32"}


def test_the_replay_leaves_a_per_block_scaled_run_bit_identical(tmp_path):
    """fp16-pertensor (lab/scaling/pertensor.py): the census's FP32 replay reuses the step's per-block factors and
    must not feed their history, so the run is the same with and without it."""
    mode = fp16("dynamic", per_tensor=True)
    m_on, on = run(tmp_path, "on", mode)
    m_off, off = run(tmp_path, "off", mode, census_fp32_replay=False)
    assert (on / "steps.csv").read_bytes() == (off / "steps.csv").read_bytes()
    assert m_on["final_val_loss"] == m_off["final_val_loss"] and m_on["census_fp32_replays"] == 3


def test_the_replay_counts_what_an_fp32_run_counts_at_the_same_scale(tmp_path):
    """At step 0 both runs hold the same weights and batch: the FP16 run's FP32 replay at scale 128 equals the
    FP32 run's counterfactual census at 128 (loss x 128 before backward or the values x 128 after: both exact)."""
    _, a = run(tmp_path, "fp16", fp16("static", scale=128), steps=1)
    _, b = run(tmp_path, "fp32", {"precision": "fp32"}, steps=1)
    fields = ("source", "layer", "total", "zero", "underflow", "subnormal", "normal", "overflow")
    replay = [tuple(r[f] for f in fields) for r in rows(a / "census.csv") if r["grads"] == "fp32"]
    reference = [tuple(r[f] for f in fields) for r in rows(b / "census.csv") if float(r["at_scale"]) == 128]
    assert replay and replay == reference


def test_a_scale_too_low_is_diagnosed_as_underflow_with_a_scale_that_keeps_it(tmp_path):
    """A planted underflow: the LM at scale 2^-12 flushes most of its activation gradients."""
    m, out = run(tmp_path, "low", fp16("static", scale=2.0 ** -12))
    assert m["flushed_activation"] >= 0.5
    d = diagnose(out)
    assert d.verdict == "issues"
    finding = next(f for f in d.findings if f.code == "fp16_underflow")
    assert finding.severity == "warning"
    act = d.fp16_loss["sources"]["activation_grad"]
    assert act["flushed"] >= 0.5 and act["direct"] <= act["flushed"] + 1e-9
    rec = next(r for r in d.recommendations if r.code == "raise_scale")
    # the recommended scale is higher than the one in use, and the replay's histogram says it keeps
    target = float(rec.action.split("static scale of ")[1].split(" = ")[-1].rstrip(")"))
    assert target > 2.0 ** -12 and d.fp16_loss["headroom_doublings"] >= 1


def test_a_well_scaled_run_is_not_warned(tmp_path):
    m, out = run(tmp_path, "ok", fp16("static", scale=2.0 ** 12))
    assert m["flushed_activation"] < 0.05
    d = diagnose(out)
    assert not any(f.code == "fp16_underflow" and f.severity != "info" for f in d.findings)
    assert not any(r.code == "raise_scale" for r in d.recommendations)


def test_without_the_replay_the_fp16_census_cannot_see_it(tmp_path):
    """The blindness the replay fixes: FP16's own census counts a flushed value as an exact zero."""
    m, out = run(tmp_path, "blind", fp16("static", scale=2.0 ** -12), census_fp32_replay=False)
    assert m["flushed_activation"] is None
    d = diagnose(out)
    assert d.fp16_loss is None
    last = max(int(r["step"]) for r in rows(out / "census.csv"))
    total = next(r for r in rows(out / "census.csv") if r["layer"] == "__total__" and int(r["step"]) == last
                 and r["source"] == "activation_grad")
    # the zeros hold what was flushed; "underflow" sees only values on the boundary, a small part of them
    assert 10 * int(total["underflow"]) < int(total["zero"])


def test_summary_and_figure_read_the_replay(tmp_path):
    from lab.report import derived as D, load as R
    run(tmp_path / "runs" / "lm" / "low", "seed0", fp16("static", scale=2.0 ** -12))
    census = R.load_census(tmp_path)
    frac = D.underflow_by_layer(census, "lm", "activation_grad")
    assert frac.loc["__total__"].iloc[0] >= 0.3  # not the ~0 that FP16's own rows show
    # the underflow figure draws the same replayed fraction: the activation-gradient panel's __total__ cell
    from lab.report import figures as F
    fig = F.underflow_figure(census, "lm", tmp_path / "underflow.png")
    assert (tmp_path / "underflow.png").stat().st_size > 0
    ax = next(a for a in fig.axes if a.get_title() == F.SOURCE_TITLES["activation_grad"])
    rows = [t.get_text() for t in ax.get_yticklabels()]
    drawn = ax.images[0].get_array()[rows.index("__total__")].max()
    assert drawn >= 0.3


# --- the rules on crafted census rows (lab/diagnose/underflow.py): each threshold on both sides ---------------
def crafted(flushed: float, top_bin: int = -10, scale: float = 1.0, n: int = 10_000):
    """One census step of an FP16 run: FP32 keeps all n activation-gradient values non-zero; FP16 held
    `flushed` of them as zero; the replay puts them in bins -30 (flushed) and top_bin (kept)."""
    lost = round(flushed * n)
    base = {"step": 0, "scale": scale, "at_scale": scale, "source": "activation_grad", "layer": "__total__",
            "total": n, "subnormal": 0, "overflow": 0}
    own = dict(base, grads="fp16", zero=lost, underflow=0, normal=n - lost)
    replay = dict(base, grads="fp32", zero=0, underflow=lost, normal=n - lost)
    hist = [{"step": 0, "source": "activation_grad", "at_scale": scale, "k": -30, "count": lost},
            {"step": 0, "source": "activation_grad", "at_scale": scale, "k": top_bin, "count": n - lost}]
    return [own, replay], hist


def rules(census, hist, policy="none"):
    from lab.diagnose.underflow import census_findings
    from lab.diagnose.record import Diagnosis, _Builder
    d = Diagnosis(run_dir="x", verdict="", headline="", precision="fp16", policy=policy, final_scale=1.0)
    b = _Builder()
    census_findings(b, d, census, hist)
    return d, {f.code: f.severity for f in b.findings}, [r.code for r in b.recs], b.recs


@pytest.mark.parametrize("subnormal, severity", [(0.95, "warning"), (0.99, "warning"), (0.94, "info")])
def test_most_values_kept_only_as_subnormals_is_a_warning(subnormal, severity):
    """docs/census.md: nothing flushed, but at least 95% of what FP32 keeps held by FP16 only as subnormals (under
    11 significant bits) is a warning too; 94% is not."""
    n = 10_000
    sub = round(subnormal * n)
    base = {"step": 0, "scale": 1.0, "at_scale": 1.0, "source": "activation_grad", "layer": "__total__",
            "total": n, "overflow": 0, "zero": 0, "underflow": 0, "subnormal": sub, "normal": n - sub}
    census = [dict(base, grads="fp16"), dict(base, grads="fp32")]
    # the subnormals in the top subnormal binade (10 significant bits: not coarser than BF16), the rest normal
    hist = [{"step": 0, "source": "activation_grad", "at_scale": 1.0, "k": -15, "count": sub},
            {"step": 0, "source": "activation_grad", "at_scale": 1.0, "k": -5, "count": n - sub}]
    d, found, recs, _ = rules(census, hist)
    assert found["fp16_underflow"] == severity
    assert d.fp16_loss["sources"]["activation_grad"]["subnormal"] == pytest.approx(sub / n)
    assert d.fp16_loss["sources"]["activation_grad"]["coarse"] == 0


def subnormal_rows(flushed: float, coarse_sub: float, fine_sub: float, n: int = 10_000):
    """One census step: of n values FP32 keeps, FP16 flushed `flushed` (bin -30), held `coarse_sub` as subnormals
    with 5 significant bits (bin -20: under 2^-17, fewer than BF16's 8), `fine_sub` as subnormals with 10 (bin -15),
    the rest normal (bin -5)."""
    lost, coarse, fine = round(flushed * n), round(coarse_sub * n), round(fine_sub * n)
    base = {"step": 0, "scale": 1.0, "at_scale": 1.0, "source": "activation_grad", "layer": "__total__",
            "total": n, "overflow": 0}
    own = dict(base, grads="fp16", zero=lost, underflow=0, subnormal=coarse + fine, normal=n - lost - coarse - fine)
    replay = dict(base, grads="fp32", zero=0, underflow=lost, subnormal=coarse + fine, normal=n - lost - coarse - fine)
    hist = [{"step": 0, "source": "activation_grad", "at_scale": 1.0, "k": k, "count": c}
            for k, c in ((-30, lost), (-20, coarse), (-15, fine), (-5, n - lost - coarse - fine)) if c]
    return [own, replay], hist


@pytest.mark.parametrize("flushed, coarse, fine, severity", [
    (0.191, 0.806, 0.0, "warning"),   # a nanoGPT loop at scale 1: 19.1% flushed, 80.6% kept only as subnormals
    (0.0, 0.80, 0.0, "warning"),      # COARSE_MATERIAL of them with 5 bits, nothing flushed
    (0.10, 0.70, 0.0, "warning"),     # flushed and coarse add up
    (0.0, 0.79, 0.0, "info"),         # under it: as the study's equivalent runs (up to 68%)
    (0.05, 0.0, 0.90, "info"),        # subnormals with 10 bits: more than BF16 keeps, not a loss of precision
])
def test_values_held_with_fewer_bits_than_bf16_count_as_lost(flushed, coarse, fine, severity):
    """Precision lost, not only values lost. A subnormal in [2^k, 2^(k+1)) keeps k + 25 bits; under
    2^-17 that is fewer than BF16's 8: such values and the flushed ones are material from COARSE_MATERIAL."""
    from lab.diagnose.underflow import COARSE_MATERIAL
    assert COARSE_MATERIAL == 0.80
    d, found, recs, rec_objs = rules(*subnormal_rows(flushed, coarse, fine))
    act = d.fp16_loss["sources"]["activation_grad"]
    assert act["coarse"] == pytest.approx(flushed + coarse)
    assert found["fp16_underflow"] == severity
    if severity == "warning":
        # the advice keeps those bits: bin -20 needs 3 doublings to reach 2^-17 (8 bits), bin -30 13
        assert recs[0] == "raise_scale" and not rec_objs[0].action.startswith("Optional")
        assert rec_objs[0].change["scale"] == 2.0 ** (13 if flushed else 3)


def test_the_verdict_never_contradicts_its_first_advice():
    """A verdict of healthy with "use a higher loss scale" as its first advice would contradict itself: a
    material loss is a warning (verdict issues, the advice first); a small one keeps the verdict healthy and says
    its advice is optional."""
    from lab.diagnose.advice import verdict
    from lab.diagnose.record import Diagnosis, _Builder
    from lab.diagnose.underflow import census_findings
    for (flushed, coarse), expected in (((0.191, 0.806), "issues"), ((0.05, 0.0), "healthy")):
        d = Diagnosis(run_dir="x", verdict="", headline="", precision="fp16", policy="none", final_scale=1.0,
                      steps=100, update_ratio=1.0, status="ok")
        b = _Builder()
        census_findings(b, d, *subnormal_rows(flushed, coarse, 0.0))
        verdict(b, d, {"status": "ok"})
        assert d.verdict == expected
        first = b.recs[0]
        assert first.code == "raise_scale"
        assert first.action.startswith("Optional") == (expected == "healthy")


@pytest.mark.parametrize("flushed,severity,advice", [
    (0.40, "warning", True),    # material: at least FLUSH_MATERIAL (0.20)
    (0.20, "warning", True),    # on the threshold
    (0.19, "info", True),       # under it: no warning, but >= 1% with headroom still gets the advice
    (0.01, "info", True),
    (0.009, "info", False),     # under 1%: nothing to advise
])
def test_flush_thresholds(flushed, severity, advice):
    from lab.diagnose.underflow import FLUSH_MATERIAL
    assert FLUSH_MATERIAL == 0.20
    d, found, recs, rec_objs = rules(*crafted(flushed))
    assert found["fp16_underflow"] == severity
    assert ("raise_scale" in recs) == advice
    assert d.fp16_loss["sources"]["activation_grad"]["flushed"] == pytest.approx(flushed, abs=1e-4)
    if advice:  # values in bin -30 need 13 doublings to reach 2^-17 (BF16's 8 bits, not only 2^-25: kept at all);
        # the kept ones (bin -10) have room for 24
        assert rec_objs[0].change["scale"] == 8192


def test_no_headroom_advises_bf16():
    d, found, recs, _ = rules(*crafted(0.5, top_bin=14))   # the largest scaled gradient already near 2^15
    assert found["fp16_underflow"] == "warning" and recs == ["bf16"] and d.fp16_loss["headroom_doublings"] == 0


def test_a_run_that_accumulates_compares_the_whole_step_with_its_replay(tmp_path):
    """train.accum_steps 4: the FP16 census counts every micro-batch of the step and the FP32 replay runs every one
    of them, so both sides count the same values and no share passes 100%."""
    m, out = run(tmp_path, "acc", fp16("static", scale=1.0), steps=4, accum_steps=4)
    census = rows(out / "census.csv")
    for step in {r["step"] for r in census}:
        for source in ("activation_grad", "param_grad"):
            own, rep = ([r for r in census if r["step"] == step and r["source"] == source and r["grads"] == g
                         and r["layer"] == "__total__"] for g in ("fp16", "fp32"))
            assert len(own) == len(rep) == 1 and own[0]["total"] == rep[0]["total"]
            assert 0 <= int(own[0]["zero"]) - int(rep[0]["zero"]) <= int(rep[0]["total"]) - int(rep[0]["zero"])
    assert 0 < m["flushed_activation"] <= 1
    d = diagnose(out)
    assert all(0 <= v["flushed"] <= 1 for v in d.fp16_loss["sources"].values())
    assert [r["micro_batches"] for r in rows(out / "steps.csv")] == ["4"] * 4

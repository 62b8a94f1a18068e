"""Claims as two one-sided tests each over summary.csv, Holm across the claims (lab/study/claims/): every
predicate kind on a crafted summary whose p-values are computed here with scipy, the overflow claims against
scipy's exact binomial test, the claims file's validation, the README section, the CLI and the rule."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from lab.cli import main
from lab.study import claims as C
from lab.study import inference
from lab.study.aggregate import aggregate
from lab.study.claims.file import load_declared
from test_aggregate import crafted
from test_workflow import snakemake

REPO = Path(__file__).resolve().parent.parent

S, X, N, O = C.SUPPORTED, C.CONTRADICTED, C.NOT_RESOLVED, C.OUT_OF_REACH
DF = 12.0


def srow(mode, top1=(0.0, 0.01), val_loss=(0.0, 0.01), model="a", spread="pooled", n_pairs=2,
         count=(0, 1000.0), grows="interval", steps=10000.0, growth=2000.0):
    """One summary row as aggregate writes it: (Δ, se) per metric (top-1 as a fraction) with DF degrees of freedom,
    margins top-1 0.01 and val loss 0.05; `count`: in-training overflow steps and their exposure (summed over
    seeds) of runs of `steps` steps under a policy that grows every `growth` steps."""
    row = {"model": model, "mode": mode, "n_pairs": n_pairs, "steps_mean": steps, "growth_interval": growth,
           "grows": grows, "overflow_count": count[0], "overflow_exposure": count[1], "confidence": 0.95}
    for name, (d, se), m in (("top1", top1, 0.01), ("val_loss", val_loss, 0.05)):
        row.update({f"{name}_delta": d, f"{name}_se": se, f"{name}_df": DF, f"{name}_spread": spread,
                    f"{name}_margin": m, f"{name}_effect": m, f"{name}_n_pairs": n_pairs,
                    f"{name}_se_seed": se, f"{name}_df_seed": DF, f"{name}_se_example": 0.0, f"{name}_note": ""})
    return row


SUMMARY = pd.DataFrame([
    srow("fp32"),
    srow("cost", top1=(-0.05, 0.005), val_loss=(0.2, 0.01)),          # large resolved costs
    srow("small", top1=(-0.001, 0.001), val_loss=(0.001, 0.002)),     # equivalent
    srow("noisy", top1=(0.0, 0.05), val_loss=(0.0, 0.3)),             # far too noisy
    srow("gain", top1=(0.03, 0.004), val_loss=(-0.15, 0.01)),         # resolved gains
    srow("tie", top1=(-0.0028, math.nan), spread="zero"),             # two seeds, the same Δ: no spread
    srow("same", top1=(0.0, 0.0), val_loss=(0.0, 0.0), spread="identical"),
])


def tm(mode, metric="top1", model="a"):
    return {"model": model, "mode": mode, "metric": metric}


def side(mode, model="a"):
    return {"model": model, "mode": mode}


def one(kind, body, summary=SUMMARY, **reach):
    return C.check(kind, body, summary, reach)


def p_above(d, se, x):  # H0: Δ ≤ x, written out with scipy
    return st.t.sf((d - x) / se, DF)


def p_below(d, se, x):  # H0: Δ ≥ x
    return st.t.cdf((d - x) / se, DF)


def holm2(p1, p2):
    """Holm over two p-values, written out."""
    lo, hi = sorted([p1, p2])
    a_lo = min(1, 2 * lo)
    a_hi = max(a_lo, min(1, hi))
    return (a_lo, a_hi) if p1 <= p2 else (a_hi, a_lo)


def expected(p_support, p_contra):
    a_s, a_c = holm2(p_support, p_contra)
    return S if a_s <= 0.05 else X if a_c <= 0.05 else None


# --- verdicts of each kind, against p-values computed here -------------------------------------------------
@pytest.mark.parametrize("mode, limit, x", [
    ("cost", "at_least", -0.003), ("cost", "at_most", -0.01), ("small", "at_least", -0.003),
    ("gain", "at_least", 0.0), ("gain", "at_most", 0.0), ("noisy", "at_least", -0.003)])
def test_bound_decides_by_its_two_one_sided_tests(mode, limit, x):
    r = SUMMARY.set_index("mode").loc[mode]
    d, se = r["top1_delta"], r["top1_se"]
    ps, pc = (p_above(d, se, x), p_below(d, se, x)) if limit == "at_least" else (p_below(d, se, x), p_above(d, se, x))
    out = one("bound", {**tm(mode), limit: x})
    want = expected(ps, pc)
    assert out.verdict == (want or out.verdict) and (want is not None or out.verdict in (N, O))
    if want is None:
        assert "paired seeds" in out.evidence


def test_bound_verdicts_by_name():
    assert one("bound", {**tm("cost"), "at_least": -0.003}).verdict == X
    assert one("bound", {**tm("cost"), "at_most": -0.01}).verdict == S
    assert one("bound", {**tm("small"), "at_least": -0.03}).verdict == S
    assert one("bound", {**tm("noisy"), "at_least": -0.003}).verdict == O  # the noise needs > 20 seeds


def test_a_zero_spread_decides_nothing_and_identical_runs_are_exact():
    """Two seeds that differ by the same whole number of images have no spread: no verdict rests on it."""
    out = one("cost", tm("tie"))
    assert out.verdict == O and "no spread" in out.evidence
    assert one("equivalent", tm("same", "val_loss")).verdict == S          # identical outcomes: Δ is exactly 0
    assert one("cost", tm("same", "val_loss")).verdict == X


@pytest.mark.parametrize("metric", ["top1", "val_loss"])
def test_cost_and_equivalence(metric):
    assert one("cost", tm("cost", metric)).verdict == S
    assert one("equivalent", tm("cost", metric)).verdict == X           # a cost beyond the margin
    assert one("equivalent", tm("small", metric)).verdict == S
    assert one("cost", tm("small", metric)).verdict == X                # shown below the margin
    assert one("cost", tm("gain", metric)).verdict == X
    assert one("equivalent", tm("gain", metric)).verdict in (N, O)      # a gain does not contradict "loses nothing"
    assert one("cost", tm("noisy", metric)).verdict in (N, O)


def test_equivalence_is_tost_at_the_declared_margin():
    r = SUMMARY.set_index("mode").loc["small"]
    d, se = r["val_loss_delta"], r["val_loss_se"]
    ps = max(p_above(d, se, -0.05), p_below(d, se, 0.05))
    [rec] = C.evaluate([{"id": "e", "text": "t", "source": "s", "equivalent": tm("small", "val_loss")}], SUMMARY)
    assert rec["p_support"] == pytest.approx(ps) and rec["verdict"] == S
    assert rec["p_adj"] == pytest.approx(holm2(ps, p_above(d, se, 0.05))[0])


def test_compare_is_welch_on_the_difference_of_two_rows():
    a, b = (SUMMARY.set_index("mode").loc[m] for m in ("cost", "small"))
    diff, se = a["top1_delta"] - b["top1_delta"], math.hypot(a["top1_se"], b["top1_se"])
    df = se ** 4 / (a["top1_se"] ** 4 / DF + b["top1_se"] ** 4 / DF)
    ps, pc = st.t.cdf(diff / se, df), st.t.sf(diff / se, df)
    body = {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("small")}
    assert one("compare", body).verdict == expected(ps, pc) == S
    assert one("compare", {**body, "is": "larger"}).verdict == X
    assert one("compare", {**body, "left": side("noisy")}).verdict in (N, O)


def test_holm_runs_across_the_claims():
    """A p-value that passes alone can fail among many claims: Holm over every test of every claim."""
    d = SUMMARY.set_index("mode").loc["cost"]
    # a row whose support p is about 0.01: significant alone, not once twenty tests share the 5%
    row = srow("mild", top1=(-0.025, 0.01))
    summary = pd.concat([SUMMARY, pd.DataFrame([row])], ignore_index=True)
    claim = {"id": "m", "text": "t", "source": "s", "cost": tm("mild")}
    assert C.evaluate([claim], summary)[0]["verdict"] == S
    many = [claim] + [{"id": f"n{i}", "text": "t", "source": "s", "cost": tm("noisy")} for i in range(10)]
    rec = C.evaluate(many, summary)[0]
    assert rec["verdict"] in (N, O) and rec["p_adj"] > 0.05
    assert d["top1_delta"] < 0


# --- overflow: exact Poisson test over a horizon of growth intervals ---------------------------------------
DYN = "fp16-dynamic"
OVERFLOW = pd.DataFrame([
    srow(DYN, model="hi", count=(30, 20000.0)),
    srow(DYN, model="lo", count=(4, 20000.0)),
    srow(DYN, model="mid", count=(7, 20000.0)),
    srow(DYN, model="short", count=(5, 400.0), steps=270.0),
    srow("fp16-static128", model="static", count=(20, 500.0), steps=270.0, growth=math.nan, grows="never"),
    srow("fp16-amax", model="amax", count=(20, 20000.0), growth=math.nan, grows="other"),
])


def overflow(left, right, **reach):
    mode = lambda m: OVERFLOW.set_index("model").loc[m, "mode"]  # noqa: E731
    return one("more_overflow", {"left": side(mode(left), left), "right": side(mode(right), right)}, OVERFLOW,
               **reach)


@pytest.mark.parametrize("left, right", [("hi", "lo"), ("lo", "hi"), ("mid", "lo"), ("static", "lo")])
def test_more_overflow_is_the_exact_conditional_poisson_test(left, right):
    """Given the total count, the left count is binomial with p = its share of the exposure (scipy, here)."""
    a, b = (OVERFLOW.set_index("model").loc[m] for m in (left, right))
    n, k = int(a["overflow_count"] + b["overflow_count"]), int(a["overflow_count"])
    share = a["overflow_exposure"] / (a["overflow_exposure"] + b["overflow_exposure"])
    ps = st.binomtest(k, n, share, alternative="greater").pvalue
    pc = st.binomtest(k, n, share, alternative="less").pvalue
    out = overflow(left, right)
    assert out.verdict == (expected(ps, pc) or N)


def test_overflow_horizon_and_policies_without_a_growth_interval():
    out = overflow("short", "lo")
    assert out.verdict == O and "runs are 270 steps" in out.evidence and "≥ 6000 steps" in out.evidence
    assert overflow("short", "lo", horizon_intervals=0.1).verdict != O
    out = overflow("amax", "lo")
    assert out.verdict == O and out.evidence.startswith("cannot judge: amax fp16-amax")
    assert overflow("static", "lo").verdict == S  # a fixed scale never probes: no horizon needed


def test_an_unresolved_overflow_claim_says_the_seeds_its_declared_ratio_needs():
    """Sized from the declared ratio at the right row's rate (and its lower one-sided 90% bound), not from the
    observed ratio: the seeds are the first at which inference.poisson_power reaches 80% at Holm's first level."""
    rows = OVERFLOW.copy()
    rows["n_seeds"] = 4  # 20000 steps: 5000 a run
    body = {"left": side(DYN, "mid"), "right": side(DYN, "lo"), "ratio": 3}
    out = C.check("more_overflow", body, rows)
    assert out.verdict == N and "a rate 3x lo fp16-dynamic's (0.20 per 1000 steps; runs of 5000 steps)" in out.evidence
    lo, hi = (int(n) for n in re.search(r"needs (\d+)–(\d+) paired seeds", out.evidence).groups())
    level = 0.05 / 2  # one claim alone: sized at 5% two-sided, so 2.5% on its one side
    rate = 4 / 20000.0
    assert inference.poisson_power(3 * rate, rate, lo * 5000, level) >= 0.8
    assert inference.poisson_power(3 * rate, rate, (lo - 1) * 5000, level) < 0.8
    assert hi > lo  # the lower bound of the rate needs more
    assert "seeds" not in C.check("more_overflow", {k: body[k] for k in ("left", "right")}, rows).evidence


def test_poisson_power_is_the_tests_rejection_rate_in_simulation():
    """The exact conditional test (inference.poisson_compare, statsmodels) run on simulated Poisson counts rejects
    as often as poisson_power says, within Monte Carlo error (3 sd)."""
    rng = np.random.default_rng(7)
    rate, exposure, level, sims = 2e-4, 30000.0, 0.01, 1500
    for ratio in (1.0, 3.0):
        predicted = inference.poisson_power(ratio * rate, rate, exposure, level)
        counts = rng.poisson([ratio * rate * exposure, rate * exposure], size=(sims, 2))
        rejected = np.mean([inference.poisson_compare(a, exposure, b, exposure)["p_larger"] <= level
                            for a, b in counts])
        assert abs(rejected - predicted) <= 3 * math.sqrt(predicted * (1 - predicted) / sims) + 1e-9, ratio


# --- all ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts, verdict", [
    ([("equivalent", "small"), ("cost", "cost")], S),
    ([("equivalent", "small"), ("equivalent", "cost")], X),     # one part contradicted
    ([("equivalent", "small"), ("cost", "noisy")], O),          # one part needs > 20 seeds
    ([("equivalent", "small"), ("cost", "tie")], O),            # one part has no spread
])
def test_all(parts, verdict):
    assert one("all", [{k: tm(m)} for k, m in parts]).verdict == verdict


# --- needs and missing rows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, body, text", [
    ("bound", {**tm("x"), "at_least": -0.003}, "top-1 Δ ≥ -0.30 pp, same seeds and examples"),
    ("cost", tm("x", "val_loss"), "validation-loss cost > 0 nats, same seeds and examples"),
    ("equivalent", tm("cost", "val_loss"), "validation-loss equivalence within ±0.050 nats (TOST, declared margin)"),
    ("compare", {"metric": "top1", "left": side("a"), "is": "smaller", "right": side("b")},
     "top-1 Δ of a a < Δ of a b, Welch t on the difference"),
    ("more_overflow", {"left": side("a"), "right": side("b")},
     "in-training overflow steps over their exposure, horizon ≥ 3 growth intervals, exact Poisson test"),
])
def test_needs(kind, body, text):
    assert C.needs(kind, body, SUMMARY) == text


@pytest.mark.parametrize("kind, body", [
    ("bound", {**tm("cost", model="zz"), "at_least": 0.0}),
    ("compare", {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("cost", "zz")}),
    ("equivalent", tm("cost", model="zz")),
    ("cost", tm("absent-mode")),
    ("more_overflow", {"left": side("cost", "zz"), "right": side("small")}),
])
def test_missing_model_or_mode_is_not_resolved(kind, body):
    out = one(kind, body)
    assert out.verdict == N and "no rows for " in out.evidence


def test_summary_without_a_column_is_not_resolved():
    out = one("cost", tm("cost", "val_loss"), SUMMARY.drop(columns=["val_loss_delta"]))
    assert out == C.Outcome(N, "a cost: summary.csv has no val_loss_delta column (re-run aggregate)")


def test_reach_settings_are_checked():
    for bad, message in (({"power": 1.5}, "power must lie between 0 and 1"),
                         ({"max_seeds": 1}, "max_seeds must be a whole number ≥ 2"),
                         ({"horizon_intervals": -1}, "horizon_intervals must be a number ≥ 0"),
                         ({"seeds": 3}, "unknown setting(s) seeds")):
        with pytest.raises(C.ClaimsError, match=message.replace("(", r"\(").replace(")", r"\)")):
            C.evaluate([{**GOOD, "cost": tm("noisy")}], SUMMARY, bad)


def test_verdicts_on_a_summary_written_by_aggregate(tmp_path):
    """The column names claims.py reads are the ones aggregate writes (test_aggregate's crafted runs)."""
    aggregate(crafted(tmp_path), tmp_path / "s.csv", tmp_path / "s.md")
    summary = C.load_summary(tmp_path / "s.csv")
    m = {"model": "m"}
    assert one("cost", {**m, "mode": "cost", "metric": "val_loss"}, summary).verdict == S
    assert one("cost", {**m, "mode": "better", "metric": "val_loss"}, summary).verdict == X
    assert {"steps_mean", "growth_interval", "overflow_count", "overflow_exposure", "grows", "confidence",
            "top1_margin", "val_loss_margin", "top1_se", "top1_df"} <= set(summary.columns)


# --- the claims file --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mean, sd, n, limit, x", [
    (0.80, 0.05, 4, "at_least", 0.5), (0.30, 0.05, 4, "at_least", 0.5), (0.52, 0.10, 4, "at_least", 0.5),
    (0.10, 0.02, 3, "at_most", 0.5), (0.90, 0.02, 3, "at_most", 0.5)])
def test_share_is_a_one_sample_t_over_seeds(mean, sd, n, limit, x):
    summary = pd.DataFrame([{"model": "a", "mode": "m", "n_seeds": n, "below_normal_adapter": mean,
                             "below_normal_adapter_sd": sd, "confidence": 0.95}])
    t = (mean - x) / (sd / math.sqrt(n))
    above, below = st.t.sf(t, n - 1), st.t.cdf(t, n - 1)
    ps, pc = (above, below) if limit == "at_least" else (below, above)
    out = one("share", {"model": "a", "mode": "m", "column": "below_normal_adapter", limit: x}, summary)
    want = expected(ps, pc)
    assert out.verdict == (want or N)
    summary.loc[0, "below_normal_adapter_sd"] = 0.0  # every seed the same share: nothing to decide on
    assert one("share", {"model": "a", "mode": "m", "column": "below_normal_adapter", limit: x}, summary).verdict == O


def test_the_study_claims_file_is_valid_and_evaluates():
    claims = C.load_claims(REPO / "configs" / "claims.yaml")
    assert len(claims) >= 6
    def kinds(pred: dict) -> set:
        kind, body = next(iter(pred.items()))
        return {kind}.union(*(kinds(p) for p in body)) if kind == "all" else {kind}
    others = [c for name in ("claims_finetune.yaml", "claims_multimodal.yaml")
              for c in C.load_claims(REPO / "configs" / name)]
    used = set().union(*(kinds({k: v for k, v in c.items() if k not in C.CLAIM_KEYS}) for c in claims + others))
    assert used == set(C.kinds("summary"))  # every summary kind is used by one of the study's claims files
    rl = [c for name in ("claims_rl.yaml", "claims_controllers.yaml", "claims_alerts.yaml", "claims_fsdp.yaml",
                         "claims_long_context.yaml")
          for c in C.load_file(REPO / "configs" / name, reads="runs")["claims"]]
    rl += [c for c in C.load_claims(REPO / "configs" / "claims_qlora.yaml") if c.get("reads") == "runs"]
    used = set().union(*(kinds({k: v for k, v in c.items() if k not in C.CLAIM_KEYS}) for c in rl)) - {"all"}
    # and every runs kind by the RL, controllers, alert, FSDP, long-context or QLoRA study's
    assert used == set(C.kinds("runs"))
    # none of its models is in these tables (its `reads: runs` claims: the per-run table, lab aggregate's runs.csv)
    records = C.evaluate(claims, {"summary": SUMMARY, "runs": pd.DataFrame(columns=["model", "mode", "seed"])})
    assert {r["verdict"] for r in records} <= {N, O}
    assert all("no rows for " in r["evidence"] or "has no runs in the table" in r["evidence"] for r in records)
    declared = load_declared(REPO / "configs" / "claims.yaml")
    assert set(declared) == {"resnet50", "mobilenetv2", "vit", "lm"}
    assert all(d["reason"] and d["margin"] > 0 for fam in declared.values() for d in fam.values())


GOOD = {"id": "c1", "text": "t", "source": "s"}


@pytest.mark.parametrize("claim, message", [
    ({**GOOD, "bond": tm("x")}, "claim c1: unknown predicate kind 'bond'; allowed: bound, compare, equivalent, "
                                "cost, more_overflow, share, all"),
    ({**GOOD, "cost": {**tm("x"), "metrc": "top1"}}, "claim c1: cost: unknown key(s) metrc; allowed: metric, mode, "
                                                      "model"),
    ({**GOOD, "cost": {"model": "a", "mode": "b"}}, "claim c1: cost: missing key(s) metric"),
    ({**GOOD, "cost": tm("x", "top5")}, "claim c1: cost.metric: 'top5' is not allowed; allowed: top1, val_loss"),
    ({**GOOD, "bound": tm("x")}, "claim c1: bound needs exactly one of at_least, at_most"),
    ({**GOOD, "bound": {**tm("x"), "at_least": -1, "at_most": 1}}, "exactly one of at_least, at_most"),
    ({**GOOD, "bound": {**tm("x"), "at_least": "0.3pp"}}, "bound.at_least must be a number"),
    ({**GOOD, "compare": {"metric": "top1", "left": side("x"), "is": "bigger", "right": side("y")}},
     "claim c1: compare.is: 'bigger' is not allowed; allowed: larger, smaller"),
    ({**GOOD, "compare": {"metric": "top1", "left": {"model": "x"}, "is": "larger", "right": side("y")}},
     "claim c1: compare.left: missing key(s) mode"),
    ({**GOOD, "more_overflow": {"left": side("x"), "right": side("y"), "column": "loss"}},
     "allowed: overflow_per_1k, overflow_steps, skipped_pct"),
    ({**GOOD, "all": [{"cost": tm("x")}, {"nope": {}}]}, "claim c1: unknown predicate kind 'nope'"),
    ({**GOOD, "all": []}, "claim c1: `all` needs a non-empty list of predicates"),
    ({**GOOD, "cost": tm("x"), "equivalent": tm("x")}, "claim c1: needs exactly one predicate, got cost, equivalent"),
    ({**GOOD}, "claim c1: needs exactly one predicate, got none; allowed: bound"),
    ({"id": "c1", "text": "t", "cost": tm("x")}, "claim c1: needs `source`"),
    ({"text": "t", "source": "s", "cost": tm("x")}, "claim #1 needs an `id`"),
    ({**GOOD, "cost": {**tm("x"), "model": 50}}, "claim c1: cost.model: expected a name"),
])
def test_validation_errors_name_the_claim_and_the_allowed_values(claim, message):
    with pytest.raises(C.ClaimsError) as e:
        C.validate_claims([claim])
    assert message in str(e.value)


def test_validation_of_the_file_as_a_whole(tmp_path):
    with pytest.raises(C.ClaimsError, match="appears twice"):
        C.validate_claims([{**GOOD, "cost": tm("x")}, {**GOOD, "cost": tm("y")}])
    with pytest.raises(C.ClaimsError, match="expected a non-empty list of claims"):
        C.validate_claims({"claims": []})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- id: c1\n  text: [unclosed\n")
    with pytest.raises(C.ClaimsError, match="not valid YAML"):
        C.load_claims(bad)
    with pytest.raises(C.ClaimsError, match="not found"):
        C.load_claims(tmp_path / "none.yaml")


# --- markdown and the README section ----------------------------------------------------------------------
RECORDS = [{"id": "c1", "text": "a | b", "source": "s", "verdict": S, "needs": "top-1 cost > 0 pp",
            "evidence": "x ± y", "p_adj": 0.012}]


def test_markdown_table_and_legend():
    lines = C.to_markdown(RECORDS).splitlines()
    assert lines[:3] == ["| claim | verdict | p_adj | needs | evidence |", "|---|---|---|---|---|",
                         "| a \\| b (`c1`) | **supported** | 0.012 | top-1 cost > 0 pp | x ± y |"]
    assert lines[3] == "" and lines[4] == C.LEGEND and len(lines) == 5
    for words in ("Holm", "family-wise error 5%", "out of reach", "80% power", "more than 20 seeds",
                  "3 growth intervals", "exact Poisson"):
        assert words in C.LEGEND
    other = C.to_markdown(RECORDS, {"max_seeds": 50, "power": 0.9, "horizon_intervals": 2}).splitlines()[4]
    assert "more than 50 seeds" in other and "90% power" in other and "2 growth intervals" in other


def test_text_output_has_needs_below_the_verdict():
    assert C.to_text([{**RECORDS[0], "verdict": O}]) == (
        "out of reach  c1: a | b\n              needs: top-1 cost > 0 pp\n              x ± y\n")


def test_readme_section_is_replaced_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    start, end = C.MARKERS
    readme.write_text(f"# T\n\nbefore\n{start}\nstale findings\n{end}\nafter\n")
    assert C.write_readme_section(readme, "| new |\n")
    assert readme.read_text() == f"# T\n\nbefore\n{start}\n| new |\n{end}\nafter\n"
    assert not C.write_readme_section(readme, "| new |\n")  # unchanged: not rewritten
    for text in ("# no markers\n", f"{end}\n{start}\n", f"{start} only\n"):
        readme.write_text(text)
        with pytest.raises(C.ClaimsError, match="needs the markers"):
            C.write_readme_section(readme, "x")
        assert readme.read_text() == text


# --- CLI and rule -----------------------------------------------------------------------------------------
CLAIMS = [
    {"id": "holds", "text": "costs", "source": "s", "cost": tm("cost")},
    {"id": "fails", "text": "no cost", "source": "s", "equivalent": tm("cost")},
    {"id": "far", "text": "small", "source": "s", "bound": {**tm("noisy"), "at_least": -0.003}},
    {"id": "gone", "text": "lm", "source": "s", "cost": tm("fp16-noscale", "val_loss", model="lm")},
]


@pytest.fixture
def inputs(tmp_path):
    SUMMARY.to_csv(tmp_path / "summary.csv", index=False)
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"declared": {"a": {"top1": {"margin": 0.01, "reason": "r"}}},
                                                          "claims": CLAIMS}, sort_keys=False))
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n{C.MARKERS[0]}\nold\n{C.MARKERS[1]}\n")
    return tmp_path


def args(d, *extra):
    return ["claims", "--summary", str(d / "summary.csv"), "--claims", str(d / "claims.yaml"),
            "--md", str(d / "out" / "claims.md"), *extra]


def test_cli_prints_writes_and_updates_the_readme(inputs, capsys):
    assert main(args(inputs, "--readme", str(inputs / "README.md"))) == 0
    out = capsys.readouterr().out
    for verdict, cid in ((S, "holds"), (X, "fails"), (O, "far"), (N, "gone")):
        assert f"{verdict:<13} {cid}: " in out
    assert "no rows for lm fp16-noscale" in out
    md = (inputs / "out" / "claims.md").read_text()
    assert md.startswith("| claim | verdict | p_adj | needs | evidence |") and md.count("\n| ") == len(CLAIMS)
    # the README's section: the one table of the source's claims across the committed studies
    # (lab/report/source_claims.py; tests/test_doc_claims.py checks it against the committed claims files)
    readme = (inputs / "README.md").read_text()
    assert "| the source's claim | decided in | verdict | evidence |" in readme and "\nold\n" not in readme


def test_cli_json_and_reach_options(inputs, capsys):
    assert main(args(inputs, "--json")) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["verdict"]) for r in records] == [("holds", S), ("fails", X), ("far", O), ("gone", N)]
    assert records[0]["evidence"].startswith("a cost top1 Δ -5.00 ± ")
    assert main(args(inputs, "--json", "--max-seeds", "100000")) == 0
    far = json.loads(capsys.readouterr().out)[2]
    assert far["verdict"] in (N, O)
    assert main(args(inputs, "--power", "1.5")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reach: power must lie between 0 and 1") and err.count("\n") == 1


@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "summary.csv").unlink(), "summary.csv not found"),
    (lambda d: (d / "claims.yaml").write_text("- id: x\n  text: t\n  source: s\n  cosst: {}\n"),
     "claim x: unknown predicate kind 'cosst'; allowed: bound,"),
    (lambda d: (d / "claims.yaml").write_text("declared: {a: {top1: {margin: -1, reason: r}}}\nclaims: []\n"),
     "declared.a.top1.margin: expected a positive number"),
    (lambda d: (d / "README.md").write_text("# no markers\n"), "needs the markers"),
])
def test_cli_bad_input_exits_2_with_one_line(inputs, capsys, break_it, message):
    break_it(inputs)
    assert main(args(inputs, "--readme", str(inputs / "README.md"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (inputs / "out" / "claims.md").exists()


def test_cli_help_states_the_reach_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["claims", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in ("max_seeds", "power", "horizon_intervals"):
        assert f"(default: lab.study.claims.REACH, {C.REACH[key]:g})" in text


def test_python_m_lab_claims(inputs):
    res = subprocess.run([sys.executable, "-m", "lab", *args(inputs)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "contradicted  fails: no cost" in res.stdout


def test_rule_writes_the_table_and_reruns_on_a_claim_edit(repo_copy):
    tables = repo_copy / "results" / "tables"
    tables.mkdir(parents=True)
    SUMMARY.to_csv(tables / "summary.csv", index=False)
    # the per-run table aggregate writes beside it (configs/claims.yaml's `reads: runs` claims): no LM runs here
    (tables / "runs.csv").write_text("model,mode,seed,flushed_activation\n")
    res = snakemake(repo_copy, "--cores", "1", "results/tables/claims.md", "--allowed-rules", "claims")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tables / "claims.md").read_text().startswith("| claim | verdict | p_adj | needs | evidence |")
    assert "not resolved" in (repo_copy / "results" / "logs" / "claims.log").read_text()
    path = repo_copy / "configs" / "claims.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["claims"].append(CLAIMS[0])
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    dry = snakemake(repo_copy, "-n", "results/tables/claims.md", "--allowed-rules", "claims")
    assert dry.returncode == 0, dry.stderr[-2000:]
    stats = dry.stdout.split("Job stats:")[1].split("\n\n")[0]
    counts = {line.split()[0]: line.split()[1] for line in stats.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts == {"claims": "1", "total": "1"}, dry.stdout


def test_cli_writes_the_findings_table_between_its_markers(inputs):
    """The README's compact findings table (lab.study.aggregate.findings_markdown) is regenerated with the claims:
    one row per mode, one column per family, each cell Δ, its interval (90% where equivalent) and the verdict."""
    from lab.study.aggregate import FINDINGS_MARKERS
    summary = pd.DataFrame([
        {"model": "a", "mode": "fp32", "val_loss_mean": 2.5, "val_loss_delta": 0.0, "val_loss_delta_ci": 0.0,
         "val_loss_ci90": 0.0, "val_loss_verdict": "reference", "error_rate": "Error rate: FDR."},
        {"model": "a", "mode": "fp16-noscale", "val_loss_mean": 2.8, "val_loss_delta": 0.3,
         "val_loss_delta_ci": 0.05, "val_loss_ci90": 0.04, "val_loss_verdict": "cost",
         "error_rate": "Error rate: FDR."},
        {"model": "b", "mode": "fp16-noscale", "val_loss_mean": 1.0, "val_loss_delta": -0.001,
         "val_loss_delta_ci": 0.002, "val_loss_ci90": 0.0015, "val_loss_verdict": "equivalent",
         "error_rate": "Error rate: FDR."}])
    summary.to_csv(inputs / "summary.csv", index=False)
    readme = inputs / "README.md"
    readme.write_text(readme.read_text() + f"{FINDINGS_MARKERS[0]}\nold\n{FINDINGS_MARKERS[1]}\n")
    assert main(args(inputs, "--readme", str(readme))) == 0
    text = readme.read_text()
    section = text[text.index(FINDINGS_MARKERS[0]):text.index(FINDINGS_MARKERS[1])]
    assert "old" not in section and "| mode | a | b |" in section
    assert "| fp32 (val loss, nats) | 2.500 | — |" in section
    assert "| fp16-noscale | +0.300 ± 0.050 **cost** | -0.001 ± 0.002 equiv. |" in section
    assert "Error rate: FDR." in section


def test_seeds_are_sized_at_the_level_holm_asks_of_the_claims():
    """A claim among many is decided at Holm's first step, so its sizing is too: the same noisy
    claim needs more seeds among ten claims than alone, and exactly what the t test's power at alpha / k gives."""
    from lab.study import inference
    claim = {"id": "n", "text": "t", "source": "s", "equivalent": tm("noisy")}
    alone = C.evaluate([claim], SUMMARY)[0]
    many = C.evaluate([dict(claim, id=f"n{i}") for i in range(10)], SUMMARY)[0]
    assert alone["verdict"] in (N, O) and many["verdict"] in (N, O)
    row = SUMMARY.set_index("mode").loc["noisy"]
    var = row["top1_se_seed"] ** 2 * row["top1_n_pairs"]
    for rec, k in ((alone, 1), (many, 10)):
        lo, hi = inference.seeds_range(row["top1_margin"], var, DF, 0.0, 0.05 / k, 0.8)
        assert f"needs {inference.fmt_seeds((lo, hi))} paired seeds" in rec["evidence"], rec["evidence"]
    assert alone["evidence"] != many["evidence"]


def test_a_claim_decided_on_a_cell_the_table_leaves_open_says_why_both_stand():
    """The LM's fp16-noscale cost was 'supported' in the claims and 'n.r.' in the table. Both are
    right at their own error rates; the README says so under the claims, with each one's test and multiplicity."""
    summary = SUMMARY.copy()
    summary["top1_verdict"] = ["", "not resolved", "equivalent", "not resolved", "gain", "not resolved", "identical"]
    summary["top1_p"] = 0.01
    claims = [{"id": "c", "text": "t", "source": "s", "cost": tm("cost")},
              {"id": "n", "text": "t", "source": "s", "cost": tm("noisy")}]
    records = C.evaluate(claims, summary)
    assert [r["verdict"] for r in records][0] == S
    lines = C.table_disagreements(claims, records, summary)
    assert len(lines) == 1 and lines[0].startswith("a cost top1: supported as `c`") and "not resolved" in lines[0]
    assert " Table and claims: " + lines[0] in C.readme_markdown(records, disagreements=lines)
    summary.loc[summary["mode"] == "cost", "top1_verdict"] = "cost"   # the table agrees: nothing to say
    assert C.table_disagreements(claims, records, summary) == []


def test_a_compare_claim_is_decided_in_both_directions_at_its_declared_effect():
    """'Lowers the loss' is supported by a difference shown below 0, and contradicted by one shown
    short of the declared effect below 0: a difference the other way (lrx10's +0.58 nats), or none where the
    study has the precision for the effect (gradx10's identical runs)."""
    def compare(left, right):
        return {"metric": "val_loss", "left": side(left), "is": "smaller", "right": side(right)}
    effect = 0.05   # srow's declared val_loss effect
    assert one("compare", compare("gain", "cost")).verdict == S          # -0.35 ± 0.014
    assert one("compare", compare("cost", "gain")).verdict == X          # +0.35: the other way
    # no difference, measured to ±0.01 (one row exact, the other se 0.01): short of a 0.05 gain
    t = C.test("compare", compare("same", "fp32"), SUMMARY, C.REACH)
    assert t.p_contradict == pytest.approx(st.t.cdf((0.0 - effect) / 0.01, DF))
    assert one("compare", compare("same", "fp32")).verdict == X
    assert one("compare", compare("noisy", "fp32")).verdict in (N, O)  # ±0.3: neither


def test_a_declared_group_sequential_plan_sets_the_level_claims_are_decided_at(tmp_path):
    """A family whose seeds grew after a look is decided at its plan's nominal level for the look
    reached (lab/study/sequential.py), and the legend says so; without the plan, at 5%."""
    from lab.study import sequential
    summary = SUMMARY.copy()
    summary["n_pairs"] = 6
    plan = {"a": {"looks": [3, 6], "spending": "pocock"}}
    level = sequential.nominal_levels([3, 6], 0.05, "pocock")[1]
    assert level < 0.05
    # a claim whose Holm-adjusted p lies between the plan's level and 5%
    d = 0.01 * st.t.isf((level + 0.05) / 4, DF)   # one-sided p halfway, doubled by Holm over one claim's two tests
    summary.loc[summary["mode"] == "cost", ["top1_delta", "top1_se"]] = [-d, 0.01]
    claim = [{"id": "c", "text": "t", "source": "s", "cost": tm("cost")}]
    assert C.evaluate(claim, summary)[0]["verdict"] == S
    planned = C.evaluate(claim, summary, plans=plan)[0]
    assert planned["verdict"] != S and planned["alpha"] == pytest.approx(level)
    alpha, why = C.sequential_alpha(plan, summary, 0.05)
    assert alpha == pytest.approx(level) and "look 2 of 2" in why
    assert "Holm decides at" in C.to_markdown(C.evaluate(claim, summary, plans=plan), plan=why)
    summary["n_pairs"] = 7   # more seeds than the plan covers: refused, not silently spent
    with pytest.raises(C.ClaimsError, match="more than the plan's last look"):
        C.evaluate(claim, summary, plans=plan)


def test_the_claims_file_plans_are_checked(tmp_path):
    from lab.study.claims.file import load_claims
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"claims": [{"id": "c", "text": "t", "source": "s", "cost": tm("cost")}],
                                 "sequential": {"a": {"looks": [6, 3]}}}))
    with pytest.raises(C.ClaimsError, match=r"sequential.a.looks: expected increasing"):
        load_claims(f)
    f.write_text(yaml.safe_dump({"claims": [{"id": "c", "text": "t", "source": "s", "cost": tm("cost")}],
                                 "sequential": {"lm": {"looks": [6, 12], "spending": "obrien-fleming"}}}))
    assert C.load_sequential(f)["lm"]["looks"] == [6, 12]
    assert C.load_sequential(REPO / "configs" / "claims.yaml") == {}   # fresh seeds, analysed once

"""Claims as predicates over summary.csv (lab/study/claims.py): verdicts of every predicate kind on a crafted
summary where each is known, the claims file's validation, the README section, the CLI and the rule."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st
from statsmodels.stats.power import TTestIndPower, TTestPower

from lab.cli import main
from lab.study import claims as C
from lab.study import stats
from lab.study.aggregate import aggregate
from test_aggregate import OFFSETS, crafted
from test_workflow import snakemake

REPO = Path(__file__).resolve().parent.parent

S, X, N, O = C.SUPPORTED, C.CONTRADICTED, C.NOT_RESOLVED, C.OUT_OF_REACH


def srow(mode, top1=(0.0, 0.0), val_loss=(0.0, 0.0), eq=(False, False), overflow=0.0, skipped=0.0, n_pairs=4,
         model="a", rate=(0.0, 0.0), steps=10000.0, growth=2000.0, n_seeds=None):
    """One summary row: (delta, ci) per metric as aggregate writes them (top-1 as a fraction); `rate` is the
    in-training overflow steps per 1000 steps (mean, sd over seeds) of runs of `steps` optimizer steps under a
    policy that grows every `growth` steps (NaN: static)."""
    n_seeds = n_pairs if n_seeds is None else n_seeds
    row = {"model": model, "mode": mode, "n_seeds": n_seeds, "n_pairs": n_pairs,
           "overflow_steps": overflow, "skipped_pct": skipped, "steps_mean": steps, "growth_interval": growth,
           "overflow_per_1k": rate[0], "overflow_per_1k_sd": rate[1]}
    for name, (d, ci), e in (("top1", top1, eq[0]), ("val_loss", val_loss, eq[1])):
        row.update({f"{name}_delta": d, f"{name}_delta_ci": ci, f"{name}_equivalent": e, f"{name}_n_pairs": n_pairs})
    return row


SUMMARY = pd.DataFrame([
    srow("fp32", eq=(True, True)),
    srow("cost", top1=(-0.05, 0.01), val_loss=(0.2, 0.02), overflow=10.0, skipped=8.0),   # resolved costs
    srow("small", top1=(-0.001, 0.001), val_loss=(0.001, 0.002), eq=(True, True), overflow=0.5, skipped=0.4),
    srow("noisy", top1=(0.0, 0.05), val_loss=(0.0, 0.3), overflow=1.0, skipped=0.9),       # far too noisy
    srow("near", top1=(-0.006, 0.008), val_loss=(0.02, 0.03)),     # not resolved, a few more seeds would do
    srow("gain", top1=(0.02, 0.005), val_loss=(-0.1, 0.01)),                                # resolved gains
    srow("tiny_cost", top1=(-0.004, 0.002), eq=(True, False)),     # a resolved cost inside the margin
    srow("one_seed", top1=(-0.05, math.nan), n_pairs=1),           # no interval
])


def side(mode, model="a"):
    return {"model": model, "mode": mode}


def one(kind, body, summary=SUMMARY, **reach):
    return C.check(kind, body, summary, reach)


def bound(mode, **limit):
    return {"model": "a", "mode": mode, "metric": limit.pop("metric", "top1"), **limit}


def tm(mode, metric="top1", model="a"):
    return {"model": model, "mode": mode, "metric": metric}


def sd(ci, n, confidence=0.95):
    """The within-pair SD behind a Student-t half width (written out here, not taken from lab.study.claims)."""
    return ci * math.sqrt(n) / st.t.ppf((1 + confidence) / 2, n - 1)


def paired_seeds(effect, sd_, alpha=0.05, power=0.8, alternative="two-sided"):
    return math.ceil(TTestPower().solve_power(effect_size=effect / sd_, nobs=None, alpha=alpha, power=power,
                                              alternative=alternative))


# --- verdicts of each kind --------------------------------------------------------------------------------
@pytest.mark.parametrize("body, verdict", [
    (bound("small", at_least=-0.003), S),       # [-0.2, 0.0] pp >= -0.3
    (bound("cost", at_least=-0.003), X),        # [-6, -4] pp entirely below
    (bound("near", at_least=-0.01), N),         # [-1.4, +0.2] pp straddles -1 pp; 0.4 pp away: 15 pairs do it
    (bound("noisy", at_least=-0.003), O),       # straddles; 0.3 pp against sd 3.1 pp: 863 pairs
    (bound("cost", at_most=-0.01), S),
    (bound("gain", at_most=-0.01), X),
    (bound("noisy", at_most=-0.01), O),
    (bound("cost", at_most=0.1, metric="val_loss"), X),   # [0.18, 0.22] nats > 0.1
    (bound("one_seed", at_least=-0.003), N),    # a mean alone decides nothing, nor sizes anything
])
def test_bound(body, verdict):
    assert one("bound", body).verdict == verdict


def test_bound_evidence_has_the_interval_and_the_bound():
    out = one("bound", bound("cost", at_least=-0.003))
    assert out.evidence == "a cost top1 Δ -5.00 ± 1.00 pp = [-6.00, -4.00], claim Δ ≥ -0.30 pp"
    assert "no interval: 1 pair(s)" in one("bound", bound("one_seed", at_least=-0.003)).evidence


@pytest.mark.parametrize("left, is_, right, verdict", [
    ("cost", "smaller", "small", S),
    ("gain", "smaller", "small", X),
    ("noisy", "smaller", "small", O),      # 0.1 pp apart at a pooled sd of 2.2 pp
    ("near", "smaller", "small", N),       # 0.5 pp apart at a pooled sd of 0.4 pp
    ("gain", "larger", "cost", S),
    ("cost", "larger", "gain", X),
    ("one_seed", "smaller", "small", N),
])
def test_compare(left, is_, right, verdict):
    out = one("compare", {"metric": "top1", "left": side(left), "is": is_, "right": side(right)})
    assert out.verdict == verdict


def test_compare_evidence_names_both_rows():
    out = one("compare", {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("small")})
    assert out.evidence == "a cost top1 Δ -5.00 ± 1.00 pp vs a small -0.10 ± 0.10 pp, claim: smaller"


@pytest.mark.parametrize("body, verdict", [
    (tm("small"), S), (tm("small", "val_loss"), S),
    (tm("cost"), X), (tm("cost", "val_loss"), X),
    (tm("noisy"), O),
    (tm("near"), N),
    (tm("gain"), O),          # a gain beyond the margin: never equivalent, and no cost to resolve either
    (tm("tiny_cost"), S),     # cost resolved, but inside the margin fixed in advance
    (tm("one_seed"), N),
])
def test_equivalent(body, verdict):
    assert one("equivalent", body).verdict == verdict


@pytest.mark.parametrize("body, verdict", [
    (tm("cost"), S), (tm("cost", "val_loss"), S),   # top-1 down; validation loss up
    (tm("gain"), X), (tm("gain", "val_loss"), X),   # top-1 up; validation loss down
    (tm("small"), X),                                # equivalent
    (tm("noisy"), O),
    (tm("near"), N),
    (tm("tiny_cost"), S),
    (tm("one_seed"), N),
])
def test_cost(body, verdict):
    assert one("cost", body).verdict == verdict


def test_tost_evidence_says_what_was_resolved():
    assert one("equivalent", tm("tiny_cost")).evidence == (
        "a tiny_cost top1 Δ -0.40 ± 0.20 pp, cost resolved, TOST equivalent")
    assert "no resolved difference, TOST not equivalent; " in one("cost", tm("noisy", "val_loss")).evidence


# --- reach: the seeds a claim that is not resolved would need ---------------------------------------------
def test_a_not_resolved_bound_states_the_paired_seeds_that_would_resolve_it():
    """near: Δ -0.6 ± 0.8 pp over 4 pairs, claim Δ ≥ -1 pp: 0.4 pp from the bound at sd 0.8 * 2 / t(0.975, 3)."""
    n = paired_seeds(0.004, sd(0.008, 4))
    assert 4 < n <= C.REACH["max_seeds"]
    out = one("bound", bound("near", at_least=-0.01))
    assert out.verdict == N
    assert out.evidence == ("a near top1 Δ -0.60 ± 0.80 pp = [-1.40, +0.20], claim Δ ≥ -1.00 pp; "
                            f"about {n} paired seeds would resolve it (80% power)")
    n90 = paired_seeds(0.004, sd(0.008, 4), power=0.9)
    assert n90 > n and f"about {n90} paired seeds" in one("bound", bound("near", at_least=-0.01), power=0.9).evidence


def test_confidence_comes_from_the_summary():
    summary = SUMMARY.assign(confidence=0.9)
    n = paired_seeds(0.004, sd(0.008, 4, 0.9), alpha=0.1)
    assert n != paired_seeds(0.004, sd(0.008, 4))
    assert f"about {n} paired seeds" in one("bound", bound("near", at_least=-0.01), summary).evidence


def test_a_bound_that_needs_more_than_max_seeds_is_out_of_reach():
    n = paired_seeds(0.003, sd(0.05, 4))  # noisy: Δ 0 ± 5 pp, claim Δ ≥ -0.3 pp
    assert n > C.REACH["max_seeds"]
    out = one("bound", bound("noisy", at_least=-0.003))
    assert out.verdict == O
    assert out.evidence.endswith(f"; a 0.30 pp distance to the bound at the observed spread (sd "
                                 f"{100 * sd(0.05, 4):.2f} pp over 4 pairs) needs about {n} paired seeds (80% power); "
                                 "the study has 4, at most 20 in reach")
    assert one("bound", bound("noisy", at_least=-0.003), max_seeds=n).verdict == N
    assert one("bound", bound("noisy", at_least=-0.003), max_seeds=n - 1).verdict == O
    near = paired_seeds(0.004, sd(0.008, 4))
    assert one("bound", bound("near", at_least=-0.01), max_seeds=near - 1).verdict == O


def test_a_mean_on_the_bound_is_out_of_reach_and_one_pair_stays_not_resolved():
    on = pd.DataFrame([srow("on", top1=(-0.003, 0.002))])
    out = one("bound", bound("on", at_least=-0.003), on)
    assert out.verdict == O
    assert out.evidence.endswith("Δ sits on the bound: no number of seeds moves the interval off it")
    out = one("bound", bound("one_seed", at_least=-0.003))
    assert out.verdict == N and out.evidence.endswith("; fewer than 2 pairs: no spread to size the seeds needed")


def test_cost_and_equivalence_take_the_cheaper_way_to_a_verdict():
    s_ = sd(0.008, 4)  # near: Δ -0.6 ± 0.8 pp, margin 1 pp
    resolve, tost = paired_seeds(0.006, s_), paired_seeds(0.004, s_, alternative="larger")
    assert resolve < tost  # resolving the cost (supports `cost`, contradicts `equivalent`) is the cheaper way
    assert one("cost", tm("near")).evidence.endswith(f"about {resolve} paired seeds would resolve it (80% power)")
    assert one("equivalent", tm("near")).evidence.endswith(
        f"about {resolve} paired seeds would resolve it (80% power, by resolving the cost, which contradicts it)")
    # a wider margin (still not shown equivalent over 4 pairs) makes TOST the cheaper way; the margin comes
    # from the summary's column
    wide = SUMMARY.assign(top1_margin=0.0115)
    tost = paired_seeds(0.0055, s_, alternative="larger")
    assert tost < resolve
    assert one("equivalent", tm("near"), wide).evidence.endswith(
        f"about {tost} paired seeds would resolve it (80% power)")
    assert one("cost", tm("near"), wide).evidence.endswith(
        f"about {tost} paired seeds would resolve it (80% power, by TOST equivalence, which contradicts it)")


def test_equivalence_outside_the_margin_on_the_gain_side_is_out_of_reach():
    out = one("equivalent", tm("gain"))
    assert out.verdict == O
    assert out.evidence.endswith("Δ +2.00 pp lies outside the ±1.00 pp margin: no number of seeds shows equivalence")


def test_compare_sizes_seeds_per_row_with_the_pooled_sd():
    pooled = math.sqrt((sd(0.008, 4) ** 2 + sd(0.001, 4) ** 2) / 2)  # near vs small, 4 pairs each
    n = math.ceil(TTestIndPower().solve_power(effect_size=0.005 / pooled, nobs1=None, alpha=0.05, power=0.8))
    out = one("compare", {"metric": "top1", "left": side("near"), "is": "smaller", "right": side("small")})
    assert out.verdict == N and out.evidence.endswith(f"about {n} seeds per row would resolve it (80% power)")
    # two Δs all but equal: no study separates them
    twins = pd.DataFrame([srow("x", top1=(-0.01, 0.01)), srow("y", top1=(-0.01 + 1e-12, 0.01))])
    out = one("compare", {"metric": "top1", "left": side("x"), "is": "smaller", "right": side("y")}, twins)
    assert out.verdict == O and "needs more than 1,000,000 seeds per row" in out.evidence


@pytest.mark.parametrize("paired", [True, False])
def test_seeds_needed_counts_whole_seeds_where_the_root_finder_gives_up(monkeypatch, paired):
    solver, nobs = (TTestPower, "nobs") if paired else (TTestIndPower, "nobs1")
    expect = math.ceil(solver().solve_power(effect_size=0.4, alpha=0.05, power=0.8, **{nobs: None}))
    assert stats.seeds_needed(0.4, 0.05, 0.8, paired=paired) == expect
    monkeypatch.setattr(solver, "solve_power", lambda self, **kw: math.nan)
    assert stats.seeds_needed(0.4, 0.05, 0.8, paired=paired) == expect
    assert stats.seeds_needed(0.0, 0.05, 0.8, paired=paired) == math.inf      # no effect: no number of seeds
    assert stats.seeds_needed(-0.4, 0.05, 0.8, paired=paired) == math.inf     # the wrong side
    assert stats.seeds_needed(1e-4, 0.05, 0.8, paired=paired) == math.inf     # past SEEDS_CAP
    assert stats.seeds_needed(50.0, 0.05, 0.8, paired=paired) == 2


def test_reach_settings_are_checked():
    for bad, message in (({"power": 1.5}, "power must lie between 0 and 1"),
                         ({"max_seeds": 1}, "max_seeds must be a whole number ≥ 2"),
                         ({"horizon_intervals": -1}, "horizon_intervals must be a number ≥ 0"),
                         ({"seeds": 3}, "unknown setting(s) seeds")):
        with pytest.raises(C.ClaimsError, match=message.replace("(", r"\(").replace(")", r"\)")):
            C.evaluate([{**GOOD, "cost": tm("near")}], SUMMARY, bad)


# --- overflow: in-training rates over a horizon of growth intervals -----------------------------------------
DYN = "fp16-dynamic"
OVERFLOW = pd.DataFrame([
    srow(DYN, model="hi", rate=(12.0, 2.0)),                              # 4 seeds of 10000 steps each
    srow(DYN, model="lo", rate=(1.0, 0.5)),
    srow(DYN, model="mid", rate=(2.0, 1.2)),                              # overlaps lo
    srow(DYN, model="close", rate=(1.3, 0.8), n_seeds=3),                 # 0.3 from lo
    srow(DYN, model="short", rate=(50.0, 5.0), steps=270.0),              # 270 steps, grows every 2000
    srow("fp16-static128", model="static", rate=(9.0, 1.0), steps=270.0, growth=math.nan),  # never grows
    srow(DYN, model="solo", rate=(9.0, math.nan), n_seeds=1),
])


def overflow(left, right, frame=OVERFLOW, **reach):
    return one("more_overflow", {"left": side(DYN if left != "static" else "fp16-static128", left),
                                 "right": side(DYN if right != "static" else "fp16-static128", right)},
               frame, **reach)


def welch(a, b, frame=OVERFLOW):
    """The verdict a Welch t-test gives (scipy, written out here), as supported / contradicted / not resolved."""
    ra, rb = (frame[frame["model"] == m].iloc[0] for m in (a, b))
    p = st.ttest_ind_from_stats(ra["overflow_per_1k"], ra["overflow_per_1k_sd"], ra["n_seeds"],
                                rb["overflow_per_1k"], rb["overflow_per_1k_sd"], rb["n_seeds"], equal_var=False).pvalue
    return N if p >= 0.05 else S if ra["overflow_per_1k"] > rb["overflow_per_1k"] else X


@pytest.mark.parametrize("left, right, verdict", [
    ("hi", "lo", S), ("lo", "hi", X), ("hi", "mid", S), ("static", "lo", S), ("lo", "static", X),
])
def test_more_overflow_by_the_welch_interval_of_in_training_rates(left, right, verdict):
    assert welch(left, right) == verdict
    out = overflow(left, right)
    assert out.verdict == verdict
    assert out.evidence.startswith(f"{left} {'fp16-static128' if left == 'static' else DYN} overflow_per_1k ")
    assert "(Welch, 95%)" in out.evidence


def test_more_overflow_interval_numbers():
    out = overflow("hi", "lo")
    v = 2.0 ** 2 / 4 + 0.5 ** 2 / 4
    half = st.t.ppf(0.975, v ** 2 / ((2.0 ** 2 / 4) ** 2 / 3 + (0.5 ** 2 / 4) ** 2 / 3)) * math.sqrt(v)
    assert out.evidence == (f"hi {DYN} overflow_per_1k 12.00 vs lo {DYN} 1.00 in-training overflow steps per 1000 "
                            f"steps, difference +11.00 ± {half:.2f} (Welch, 95%) = "
                            f"[{11 - half:+.2f}, {11 + half:+.2f}], "
                            "claim: first > second")


def test_more_overflow_not_resolved_states_seeds_per_row_or_is_out_of_reach():
    assert welch("mid", "lo") == N
    pooled = math.sqrt((1.2 ** 2 + 0.5 ** 2) / 2)
    n = math.ceil(TTestIndPower().solve_power(effect_size=1.0 / pooled, nobs1=None, alpha=0.05, power=0.8))
    assert 4 < n <= 20
    out = overflow("mid", "lo")
    assert out.verdict == N and out.evidence.endswith(f"about {n} seeds per row would resolve it (80% power)")
    # two Δs all but equal: no study separates them
    twins = pd.DataFrame([srow("x", top1=(-0.01, 0.01)), srow("y", top1=(-0.01 + 1e-12, 0.01))])
    out = one("compare", {"metric": "top1", "left": side("x"), "is": "smaller", "right": side("y")}, twins)
    assert out.verdict == O and "needs more than 1,000,000 seeds per row" in out.evidence
    pooled = math.sqrt((2 * 0.8 ** 2 + 3 * 0.5 ** 2) / 5)  # 3 and 4 seeds
    n = math.ceil(TTestIndPower().solve_power(effect_size=0.3 / pooled, nobs1=None, alpha=0.05, power=0.8))
    out = overflow("close", "lo")
    assert n > 20 and out.verdict == O
    assert out.evidence.endswith(f"a 0.30 per 1k steps difference at the observed spread (sd {pooled:.2f} per 1k "
                                 f"steps over 3 and 4 seeds) needs about {n} seeds per row (80% power); the study "
                                 "has 3 per row, at most 20 in reach")
    out = overflow("solo", "lo")
    assert out.verdict == N and out.evidence.endswith("fewer than 2 seeds: no spread to size the seeds needed")


def test_overflow_runs_shorter_than_the_horizon_are_out_of_reach():
    out = overflow("short", "lo")
    assert out == C.Outcome(O, f"short {DYN}: runs are 270 steps; {DYN} grows every 2000 steps: a horizon of 3 "
                               "growth intervals needs ≥ 6000 steps")
    assert overflow("lo", "short").verdict == O
    # a static policy never grows: no horizon, however short its runs
    assert overflow("static", "lo").verdict == S
    # the horizon is a setting: 0.1 growth intervals are 200 steps, which the short runs span
    assert overflow("short", "lo", horizon_intervals=0.1).verdict == S
    at_edge = OVERFLOW.assign(steps_mean=6000.0)
    assert overflow("hi", "lo", at_edge).verdict == S                       # 6000 steps = 3 × 2000: enough
    assert overflow("hi", "lo", OVERFLOW.assign(steps_mean=5999.0)).verdict == O


def test_old_overflow_columns_keep_the_difference_of_one_rule():
    for column, left, right, verdict in (("overflow_steps", "cost", "small", S), ("overflow_steps", "small", "cost", X),
                                         ("overflow_steps", "noisy", "small", N), ("skipped_pct", "cost", "noisy", S),
                                         ("skipped_pct", "noisy", "small", N)):
        out = one("more_overflow", {"left": side(left), "right": side(right), "column": column})
        assert out.verdict == verdict
        assert out.evidence.startswith(f"a {left} {column} ") and "counts the initial descent too" in out.evidence
    old = SUMMARY.drop(columns=["steps_mean", "growth_interval", "overflow_per_1k", "overflow_per_1k_sd"])
    out = one("more_overflow", {"left": side("cost"), "right": side("small"), "column": "overflow_steps"}, old)
    assert out.verdict == S and "horizon not checked" in out.evidence
    short = SUMMARY.assign(steps_mean=100.0)  # where the summary has the horizon columns, they count here too
    assert one("more_overflow", {"left": side("cost"), "right": side("small"), "column": "overflow_steps"},
               short).verdict == O


def test_a_summary_without_the_rate_columns_is_not_resolved():
    old = OVERFLOW.drop(columns=["overflow_per_1k", "overflow_per_1k_sd", "steps_mean", "growth_interval"])
    out = overflow("hi", "lo", old)
    assert out == C.Outcome(N, f"hi {DYN}: summary.csv has no overflow_per_1k column (re-run aggregate)")


# --- all ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts, verdict", [
    ([S, S], S), ([S, X], X), ([S, N], N), ([N, X], X), (["missing", S], N), (["missing", X], X),
    ([S, O], O), ([N, O], O), ([O, X], X), (["missing", O], O), ([O, O], O),
])
def test_all(parts, verdict):
    pick = {S: {"cost": tm("cost")}, X: {"cost": tm("gain")}, N: {"cost": tm("near")},
            O: {"cost": tm("noisy")}, "missing": {"cost": tm("cost", model="zz")}}
    for p in (S, X, N, O):  # each part is what its key says
        assert one(*next(iter(pick[p].items()))).verdict == p
    out = one("all", [pick[p] for p in parts])
    assert out.verdict == verdict
    assert out.evidence.count("; ") >= len(parts) - 1


# --- needs: what each claim is about ------------------------------------------------------------------------
@pytest.mark.parametrize("kind, body, text", [
    ("bound", bound("near", at_least=-0.003), "top-1 Δ ≥ -0.30 pp, paired over seeds"),
    ("bound", bound("near", at_most=0.1, metric="val_loss"), "validation-loss Δ ≤ +0.100 nats, paired over seeds"),
    ("cost", tm("near", "val_loss"), "validation-loss cost > 0 nats, paired over seeds"),
    ("equivalent", tm("near", "val_loss"), "validation-loss equivalence within ±0.050 nats (TOST), paired over seeds"),
    ("equivalent", tm("near"), "top-1 equivalence within ±1.00 pp (TOST), paired over seeds"),
    ("compare", {"metric": "top1", "left": side("near"), "is": "smaller", "right": side("small")},
     "top-1 Δ of a near < Δ of a small, separated intervals"),
    ("more_overflow", {"left": side("hi"), "right": side("lo")},
     "in-training overflow rate per 1000 steps, horizon ≥ 3 growth intervals, Welch interval over seeds"),
    ("more_overflow", {"left": side("hi"), "right": side("lo"), "column": "skipped_pct"},
     "skipped_pct per run (counts the initial descent too), a difference ≥ 1"),
    ("all", [{"cost": tm("near")}, {"equivalent": tm("near", "val_loss")}],
     "a near: top-1 cost > 0 pp, paired over seeds; "
     "a near: validation-loss equivalence within ±0.050 nats (TOST), paired over seeds"),
])
def test_needs(kind, body, text):
    assert C.needs(kind, body, SUMMARY) == text


def test_needs_takes_the_margin_from_the_summary_and_the_horizon_from_reach():
    assert C.needs("equivalent", tm("near"), SUMMARY.assign(top1_margin=0.005)) == (
        "top-1 equivalence within ±0.50 pp (TOST), paired over seeds")
    assert C.needs("more_overflow", {"left": side("hi"), "right": side("lo")}, reach={"horizon_intervals": 5}) \
        .startswith("in-training overflow rate per 1000 steps, horizon ≥ 5 growth intervals")
    [record] = C.evaluate([{**GOOD, "cost": tm("near")}], SUMMARY)
    assert list(record) == ["id", "text", "source", "verdict", "needs", "evidence"]
    assert record["needs"] == "top-1 cost > 0 pp, paired over seeds"


@pytest.mark.parametrize("kind, body", [
    ("bound", bound("cost", at_least=0.0) | {"model": "zz"}),
    ("compare", {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("cost", "zz")}),
    ("equivalent", tm("cost", model="zz")),
    ("cost", tm("absent-mode")),
    ("more_overflow", {"left": side("cost", "zz"), "right": side("small")}),
    ("all", [{"cost": tm("cost", model="zz")}]),
])
def test_missing_model_or_mode_is_not_resolved(kind, body):
    out = one(kind, body)
    assert out.verdict == N
    assert "no rows for " in out.evidence


def test_summary_without_a_column_is_not_resolved():
    out = one("cost", tm("cost", "val_loss"), SUMMARY.drop(columns=["val_loss_delta"]))
    assert out == C.Outcome(N, "a cost: summary.csv has no val_loss_delta column (re-run aggregate)")


def test_verdicts_on_a_summary_written_by_aggregate(tmp_path):
    """The column names claims.py reads are the ones aggregate writes (test_aggregate's crafted runs)."""
    aggregate(crafted(tmp_path), tmp_path / "s.csv", tmp_path / "s.md")
    summary = C.load_summary(tmp_path / "s.csv")
    m = {"model": "m"}
    assert one("cost", {**m, "mode": "cost", "metric": "top1"}, summary).verdict == S
    assert one("cost", {**m, "mode": "cost", "metric": "val_loss"}, summary).verdict == S
    assert one("equivalent", {**m, "mode": "same", "metric": "val_loss"}, summary).verdict == S
    assert one("equivalent", {**m, "mode": "noisy", "metric": "top1"}, summary).verdict == O
    assert one("cost", {**m, "mode": "better", "metric": "top1"}, summary).verdict == X
    assert one("bound", {**m, "mode": "cost", "metric": "top1", "at_least": -0.003}, summary).verdict == X
    # the columns the overflow claims, the sizing and the margins read
    assert {"steps_mean", "growth_interval", "overflow_per_1k", "overflow_per_1k_sd", "n_seeds", "confidence",
            "top1_margin", "val_loss_margin"} <= set(summary.columns)
    # the within-pair SD recovered from the interval is the SD of the paired differences
    dt = OFFSETS["noisy"][0]
    assert C._delta(summary, "m", "noisy", "top1").sd == pytest.approx(np.std(dt, ddof=1))
    n = math.ceil(TTestPower().solve_power(effect_size=abs(np.mean(dt) + 0.003) / np.std(dt, ddof=1), alpha=0.05,
                                           power=0.8))
    assert f"needs about {n} paired seeds" in one("bound", {**m, "mode": "noisy", "metric": "top1",
                                                             "at_least": -0.003}, summary, max_seeds=2).evidence


# --- the claims file --------------------------------------------------------------------------------------
def test_the_study_claims_file_is_valid_and_evaluates():
    claims = C.load_claims(REPO / "configs" / "claims.yaml")
    assert len(claims) >= 6
    def kinds(pred: dict) -> set:
        kind, body = next(iter(pred.items()))
        return {kind}.union(*(kinds(p) for p in body)) if kind == "all" else {kind}
    assert set().union(*(kinds({k: v for k, v in c.items() if k not in C.CLAIM_KEYS}) for c in claims)) == set(C.KINDS)
    records = C.evaluate(claims, SUMMARY)  # none of its models is in this table
    assert {r["verdict"] for r in records} == {N}
    assert all("no rows for " in r["evidence"] for r in records)


GOOD = {"id": "c1", "text": "t", "source": "s"}


@pytest.mark.parametrize("claim, message", [
    ({**GOOD, "bond": tm("x")}, "claim c1: unknown predicate kind 'bond'; allowed: bound, compare, equivalent, "
                                "cost, more_overflow, all"),
    ({**GOOD, "cost": {**tm("x"), "metrc": "top1"}}, "claim c1: cost: unknown key(s) metrc; allowed: metric, mode, "
                                                      "model"),
    ({**GOOD, "cost": {"model": "a", "mode": "b"}}, "claim c1: cost: missing key(s) metric"),
    ({**GOOD, "cost": tm("x", "top5")}, "claim c1: cost.metric: 'top5' is not allowed; allowed: top1, val_loss"),
    ({**GOOD, "bound": bound("x")}, "claim c1: bound needs exactly one of at_least, at_most"),
    ({**GOOD, "bound": bound("x", at_least=-1, at_most=1)}, "exactly one of at_least, at_most"),
    ({**GOOD, "bound": bound("x", at_least="0.3pp")}, "bound.at_least must be a number"),
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
            "evidence": "x ± y"}]


def test_markdown_table_and_legend():
    lines = C.to_markdown(RECORDS).splitlines()
    assert lines[:3] == ["| claim | verdict | needs | evidence |", "|---|---|---|---|",
                         "| a \\| b (`c1`) | **supported** | top-1 cost > 0 pp | x ± y |"]
    assert lines[3] == "" and lines[4] == C.LEGEND and len(lines) == 5
    for words in ("out of reach", "80% power", "more than 20 seeds", "3 growth intervals", "needs:"):
        assert words in C.LEGEND
    # the legend states the reach settings the table was made with
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
    {"id": "far", "text": "small", "source": "s", "bound": bound("noisy", at_least=-0.003)},
    {"id": "open", "text": "near", "source": "s", "bound": bound("near", at_least=-0.01)},
    {"id": "gone", "text": "lm", "source": "s", "cost": tm("fp16-noscale", "val_loss", model="lm")},
]


@pytest.fixture
def inputs(tmp_path):
    SUMMARY.to_csv(tmp_path / "summary.csv", index=False)
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(CLAIMS, sort_keys=False))
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n{C.MARKERS[0]}\nold\n{C.MARKERS[1]}\n")
    return tmp_path


def args(d, *extra):
    return ["claims", "--summary", str(d / "summary.csv"), "--claims", str(d / "claims.yaml"),
            "--md", str(d / "out" / "claims.md"), *extra]


def test_cli_prints_writes_and_updates_the_readme(inputs, capsys):
    assert main(args(inputs, "--readme", str(inputs / "README.md"))) == 0
    out = capsys.readouterr().out
    for verdict, cid in ((S, "holds"), (X, "fails"), (O, "far"), (N, "open"), (N, "gone")):
        assert f"{verdict:<13} {cid}: " in out
    assert "no rows for lm fp16-noscale" in out
    assert f"{'':14}needs: top-1 Δ ≥ -0.30 pp, paired over seeds\n" in out
    md = (inputs / "out" / "claims.md").read_text()
    assert md.startswith("| claim | verdict | needs | evidence |") and md.count("\n| ") == len(CLAIMS)
    assert md.strip() in (inputs / "README.md").read_text()


def test_cli_json(inputs, capsys):
    assert main(args(inputs, "--json")) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["verdict"]) for r in records] == [("holds", S), ("fails", X), ("far", O), ("open", N),
                                                          ("gone", N)]
    assert records[0]["evidence"].startswith("a cost top1 Δ -5.00 ± 1.00 pp")
    assert records[0]["needs"] == "top-1 cost > 0 pp, paired over seeds"


def test_cli_reach_options(inputs, capsys):
    far = paired_seeds(0.003, sd(0.05, 4))            # the `far` claim: out of reach at 20 seeds
    near = paired_seeds(0.004, sd(0.008, 4))          # the `open` one: not resolved
    assert main(args(inputs, "--json", "--max-seeds", str(far))) == 0
    verdicts = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert verdicts["far"]["verdict"] == N and f"about {far} paired seeds" in verdicts["far"]["evidence"]
    assert f"more than {far} seeds" in (inputs / "out" / "claims.md").read_text()
    assert main(args(inputs, "--json", "--max-seeds", str(near - 1))) == 0
    assert {r["id"]: r["verdict"] for r in json.loads(capsys.readouterr().out)}["open"] == O
    n90 = paired_seeds(0.004, sd(0.008, 4), power=0.9)
    assert main(args(inputs, "--json", "--power", "0.9")) == 0
    assert f"about {n90} paired seeds would resolve it (90% power)" in json.loads(
        capsys.readouterr().out)[3]["evidence"]
    OVERFLOW.to_csv(inputs / "summary.csv", index=False)
    (inputs / "claims.yaml").write_text(yaml.safe_dump([
        {"id": "ovf", "text": "t", "source": "s",
         "more_overflow": {"left": side(DYN, "short"), "right": side(DYN, "lo")}}]))
    for extra, verdict in (((), O), (("--horizon-intervals", "0.1"), S), (("--horizon-intervals", "3"), O)):
        assert main(args(inputs, "--json", *extra)) == 0
        [record] = json.loads(capsys.readouterr().out)
        assert record["verdict"] == verdict
    assert "horizon ≥ 3 growth intervals" in record["needs"]
    assert main(args(inputs, "--power", "1.5")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reach: power must lie between 0 and 1") and err.count("\n") == 1


@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "summary.csv").unlink(), "summary.csv not found"),
    (lambda d: (d / "claims.yaml").write_text("- id: x\n  text: t\n  source: s\n  cosst: {}\n"),
     "claim x: unknown predicate kind 'cosst'; allowed: bound,"),
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
    res = snakemake(repo_copy, "--cores", "1", "results/tables/claims.md", "--allowed-rules", "claims")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tables / "claims.md").read_text().startswith("| claim | verdict | needs | evidence |")
    assert "not resolved" in (repo_copy / "results" / "logs" / "claims.log").read_text()
    with open(repo_copy / "configs" / "claims.yaml", "a") as f:
        f.write(yaml.safe_dump([CLAIMS[0]]))
    dry = snakemake(repo_copy, "-n", "results/tables/claims.md")
    assert dry.returncode == 0, dry.stderr[-2000:]
    stats = dry.stdout.split("Job stats:")[1].split("\n\n")[0]
    counts = {line.split()[0]: line.split()[1] for line in stats.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts == {"claims": "1", "total": "1"}, dry.stdout


def test_cli_writes_the_findings_table_between_its_markers(inputs):
    """The README's compact findings table (lab.study.aggregate.findings_markdown) is regenerated with the claims when
    the README has its markers: one row per mode, one column per family, each cell the paired Δ and verdict."""
    from lab.study.aggregate import FINDINGS_MARKERS
    summary = pd.DataFrame([
        {"model": "a", "mode": "fp32", "val_loss_mean": 2.5, "val_loss_delta": 0.0, "val_loss_delta_ci": 0.0,
         "val_loss_verdict": "reference"},
        {"model": "a", "mode": "fp16-noscale", "val_loss_mean": 2.8, "val_loss_delta": 0.3,
         "val_loss_delta_ci": 0.05, "val_loss_verdict": "cost resolved"},
        {"model": "b", "mode": "fp16-noscale", "val_loss_mean": 1.0, "val_loss_delta": -0.001,
         "val_loss_delta_ci": 0.002, "val_loss_verdict": "equivalent"}])
    summary.to_csv(inputs / "summary.csv", index=False)
    readme = inputs / "README.md"
    readme.write_text(readme.read_text() + f"{FINDINGS_MARKERS[0]}\nold\n{FINDINGS_MARKERS[1]}\n")
    assert main(args(inputs, "--readme", str(readme))) == 0
    text = readme.read_text()
    section = text[text.index(FINDINGS_MARKERS[0]):text.index(FINDINGS_MARKERS[1])]
    assert "old" not in section and "| mode | a | b |" in section
    assert "| fp32 (val loss, nats) | 2.500 | — |" in section
    assert "| fp16-noscale | +0.300 ± 0.050 **cost** | -0.001 ± 0.002 equiv. |" in section

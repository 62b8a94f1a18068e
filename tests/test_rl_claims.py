"""The per-run kinds of the claims engine (lab/study/claims/runs.py, the RL study's: lab/rl/claims.py hands its tables
to lab/study/claims/): each kind's verdicts on tables built to decide them, Holm over the file, the guards (zero
width, no skips, a required claim), and the family-wise error rate by simulation."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from lab.core.errors import ConfigError
from lab.study.claims import evaluate, load_file, markdown_by_test


def claims_file(tmp_path, claims, **top):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({**top, "claims": [{"text": "t", "source": "s", **c} for c in claims]}))
    return load_file(path, reads="runs")


def decide(claims, runs, shape=None):
    return evaluate(claims, {"runs": runs, **({"shape": shape} if shape is not None else {})})


def runs(**modes):
    """A runs table: mode -> {column: values per seed (seeds 0..n-1)}."""
    rows = []
    for mode, columns in modes.items():
        n = len(next(iter(columns.values())))
        for seed in range(n):
            rows.append({"mode": mode, "seed": seed, "steps": 100, **{k: v[seed] for k, v in columns.items()}})
    return pd.DataFrame(rows)


def verdicts(decided):
    return {c["id"]: c["verdict"] for c in decided}


def test_compare_supported_contradicted_and_not_resolved(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.normal(0.4, 0.05, 12)
    table = runs(ref={"solved_end": base}, worse={"solved_end": base - 0.08 + rng.normal(0, 0.01, 12)},
                 same={"solved_end": base + rng.normal(0, 0.005, 12)}, noisy={"solved_end": base - 0.05 + rng.normal(0, 0.2, 12)})
    claims = claims_file(tmp_path, [
        {"id": "worse", "compare": {"column": "solved_end", "left": "worse", "is": "smaller", "right": "ref", "effect": 0.05}},
        {"id": "same", "compare": {"column": "solved_end", "left": "same", "is": "smaller", "right": "ref", "effect": 0.05}},
        {"id": "noisy", "compare": {"column": "solved_end", "left": "noisy", "is": "smaller", "right": "ref", "effect": 0.05}},
        {"id": "wrong-way", "compare": {"column": "solved_end", "left": "ref", "is": "smaller", "right": "worse", "effect": 0.05}}])
    got = decide(claims, table, None)
    assert verdicts(got) == {"worse": "supported", "same": "contradicted", "noisy": "out of reach",
                             "wrong-way": "contradicted"}
    noisy = next(c for c in got if c["id"] == "noisy")["tests"][0]
    assert "more than 20 paired seeds" in noisy["needs"]  # sized from the declared effect at the measured spread


def test_a_zero_width_difference_decides_nothing(tmp_path):
    table = runs(a={"solved_end": [0.5, 0.6, 0.7]}, b={"solved_end": [0.4, 0.5, 0.6]})  # Δ = 0.1 on every seed
    claims = claims_file(tmp_path, [
        {"id": "c", "compare": {"column": "solved_end", "left": "b", "is": "smaller", "right": "a", "effect": 0.05}},
        {"id": "e", "equivalent": {"column": "solved_end", "left": "b", "right": "a", "margin": 0.5}}])
    assert verdicts(decide(claims, table, None)) == {"c": "not resolved", "e": "not resolved"}


def test_equivalence_inside_and_outside_the_margin(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.normal(0.5, 0.05, 10)
    table = runs(ref={"solved_end": base}, near={"solved_end": base + rng.normal(0, 0.003, 10)},
                 far={"solved_end": base + 0.2 + rng.normal(0, 0.003, 10)})
    claims = claims_file(tmp_path, [{"id": "near", "equivalent": {"column": "solved_end", "left": "near", "right": "ref", "margin": 0.03}},
                                    {"id": "far", "equivalent": {"column": "solved_end", "left": "far", "right": "ref", "margin": 0.03}}])
    assert verdicts(decide(claims, table, None)) == {"near": "supported", "far": "contradicted"}


def test_order_ratio_and_within_unit_tests(tmp_path):
    rng = np.random.default_rng(2)
    small = rng.uniform(1e-4, 2e-4, 10)
    table = runs(fp32={"m": small / 100, "lo": small, "hi": small / 2}, fp16={"m": small, "lo": small, "hi": small / 2},
                 bf16={"m": small * 8 * rng.uniform(0.9, 1.1, 10), "lo": small / 2, "hi": small})
    claims = claims_file(tmp_path, [
        {"id": "order", "order": {"column": "m", "modes": ["fp32", "fp16", "bf16"]}},
        {"id": "reverse", "order": {"column": "m", "modes": ["bf16", "fp16"]}},
        {"id": "ratio", "ratio_within": {"column": "m", "numerator": "bf16", "denominator": "fp16", "low": 4, "high": 16}},
        {"id": "ratio-off", "ratio_within": {"column": "m", "numerator": "bf16", "denominator": "fp16", "low": 20, "high": 40}},
        {"id": "within", "greater_within": {"table": "runs", "modes": ["fp16"], "larger": "lo", "smaller": "hi"}},
        {"id": "within-wrong", "greater_within": {"table": "runs", "modes": ["bf16"], "larger": "lo", "smaller": "hi"}}])
    assert verdicts(decide(claims, table, None)) == {"order": "supported", "reverse": "contradicted", "ratio": "supported",
                                                     "ratio-off": "contradicted", "within": "supported",
                                                     "within-wrong": "contradicted"}


def test_skips_none_in_either_is_out_of_reach_and_a_requirement_propagates(tmp_path):
    table = runs(a={"skipped_steps": [0, 0, 0, 0], "solved_end": [0.5, 0.4, 0.6, 0.5]},
                 b={"skipped_steps": [0, 0, 0, 0], "solved_end": [0.5, 0.41, 0.62, 0.49]},
                 c={"skipped_steps": [5, 7, 6, 4], "solved_end": [0.5, 0.4, 0.6, 0.5]})
    claims = claims_file(tmp_path, [
        {"id": "none", "fewer_skips": {"left": "a", "right": "b"}},
        {"id": "fewer", "fewer_skips": {"left": "a", "right": "c"}},
        {"id": "needs", "requires": "none", "compare": {"column": "solved_end", "left": "a", "is": "smaller",
                                                         "right": "b", "effect": 0.01}}])
    got = {c["id"]: c for c in decide(claims, table, None)}
    assert got["none"]["verdict"] == "out of reach" and "no step was skipped" in got["none"]["tests"][0]["needs"]
    assert got["fewer"]["verdict"] == "supported"
    assert got["needs"]["verdict"] == "out of reach" and "needs none supported" in got["needs"]["why"]
    same = runs(a={"skipped_steps": [0, 0, 0]}, b={"skipped_steps": [1, 1, 1]})  # 1 skip fewer on every seed
    one = decide(claims_file(tmp_path, [{"id": "s", "fewer_skips": {"left": "a", "right": "b"}}]), same, None)[0]
    assert one["verdict"] == "out of reach" and "zero width" in one["tests"][0]["needs"]
    # more skips, not shown more: not resolved, and what would decide it says there is no declared effect to size from
    more = runs(a={"skipped_steps": [2, 2, 3, 2]}, b={"skipped_steps": [1, 2, 2, 2]})
    got = decide(claims_file(tmp_path, [{"id": "m", "fewer_skips": {"left": "a", "right": "b"}}]), more, None)[0]
    assert got["verdict"] == "not resolved"
    assert "declared difference" in got["tests"][0]["needs"] and "the other way" in got["tests"][0]["needs"]


def test_holm_over_the_whole_file(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.normal(0.4, 0.05, 8)
    table = runs(ref={"solved_end": base}, worse={"solved_end": base - 0.05 + rng.normal(0, 0.02, 8)})
    one = {"compare": {"column": "solved_end", "left": "worse", "is": "smaller", "right": "ref", "effect": 0.05}}
    single = decide(claims_file(tmp_path, [{"id": "a", **one}]), table, None)[0]["tests"][0]
    many = decide(claims_file(tmp_path, [{"id": f"c{i}", **one} for i in range(5)]), table, None)
    assert single["p_holm"] == pytest.approx(single["p"])
    assert many[0]["tests"][0]["p_holm"] == pytest.approx(min(1.0, 5 * single["p"]))


def test_the_family_wise_error_rate_holds_under_the_null(tmp_path):
    """Simulated studies where no claim is true (10 paired seeds, no difference; equivalence at a true difference of
    exactly the margin): the share of files with any claim supported stays near alpha or below."""
    rng = np.random.default_rng(4)
    claims = claims_file(tmp_path, [
        *({"id": f"c{i}", "compare": {"column": f"x{i}", "left": "b", "is": "smaller", "right": "a", "effect": 0.05}}
          for i in range(4)),
        *({"id": f"e{i}", "equivalent": {"column": f"y{i}", "left": "b", "right": "a", "margin": 0.03}} for i in range(4))])
    wrong, trials = 0, 200
    for _ in range(trials):
        a = {**{f"x{i}": rng.normal(0.4, 0.05, 10) for i in range(4)}, **{f"y{i}": rng.normal(0.4, 0.05, 10) for i in range(4)}}
        b = {**{k: v + rng.normal(0, 0.03, 10) for k, v in a.items() if k[0] == "x"},
             **{k: v + 0.03 + rng.normal(0, 0.01, 10) for k, v in a.items() if k[0] == "y"}}
        # sizing off: it words what would decide a claim and never makes one supported
        wrong += any(c["verdict"] == "supported" for c in decide({**claims, "sizing": False}, runs(a=a, b=b), None))
    # alpha 0.05; the binomial sd over 200 trials is ~0.015
    assert wrong / trials <= 0.05 + 3 * 0.015, wrong / trials


def test_a_bad_claims_file_names_the_claim(tmp_path):
    for claim, said in (({"id": "x", "text": "t", "source": "s", "median": {}}, "unknown predicate kind 'median'"),
                        ({"id": "x", "text": "t", "source": "s", "compare": {"column": "c"}},
                         "compare: missing key(s) effect, is, left, right"),
                        ({"id": "x", "source": "s", "order": {"column": "c", "modes": []}}, "needs `text`"),
                        ({"id": "x", "text": "t", "source": "s", "requires": "y",
                          "order": {"column": "c", "modes": []}}, "requires 'y'")):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"claims": [claim]}))
        with pytest.raises(ConfigError, match="claim x") as e:
            load_file(path, reads="runs")
        assert said in str(e.value)


def test_the_report_names_every_claim_and_verdict(tmp_path):
    table = runs(a={"m": [1.0, 2.0, 3.0]}, b={"m": [2.0, 3.0, 5.0]})
    claims = claims_file(tmp_path, [{"id": "o", "order": {"column": "m", "modes": ["a", "b"]}}])
    text = markdown_by_test(decide(claims, table, None), "t", "Holm over the file")
    assert "**o**" in text and "Holm" in text and "in 3 of 3 seeds" in text


def test_holm_matches_statsmodels(monkeypatch):
    import gc

    from statsmodels.stats.multitest import multipletests
    monkeypatch.setattr(gc, "collect", lambda *args: 0)  # multipletests collects garbage on every call: seconds here

    from lab.study.inference import holm_adjust
    rng = np.random.default_rng(5)
    for m in (1, 2, 5, 17):
        for _ in range(5):
            p = rng.uniform(0, 1, m) ** 3
            p[rng.integers(0, m)] = p[0]  # ties
            assert np.allclose(holm_adjust(p), multipletests(p, method="holm")[1], rtol=0, atol=1e-15)
    got = holm_adjust(np.array([0.01, np.nan, 0.04]))  # NaN is not a test
    assert np.isnan(got[1]) and np.allclose(got[[0, 2]], multipletests([0.01, 0.04], method="holm")[1])


def test_each_run_a_sign_test_both_ways_and_how_many_runs_it_takes(tmp_path):
    """each_run (configs/claims_fsdp.yaml): the runs meeting a bound on a per-run count against 1/2, an exact sign
    test; n runs all on one side give 2^-n, which must pass Holm's first level (here 0.05/2 = 0.025: 6 runs)."""
    from scipy import stats as st
    table = runs(split={"d": [3, 1, 7, 2, 5, 4]}, agreed={"d": [0] * 6}, mixed={"d": [0, 2, 0, 1, 0, 3]},
                 few={"d": [1, 2, 1]})
    def pair(mode, **bound):
        return [{"id": "c", "each_run": {"column": "d", "mode": mode, **bound}},
                {"id": "other", "each_run": {"column": "d", "mode": "split", "at_least": 1}}]
    got = decide(claims_file(tmp_path, pair("split", at_least=1)), table)
    assert verdicts(got) == {"c": "supported", "other": "supported"}
    assert got[0]["tests"][0]["p"] == pytest.approx(st.binom.sf(5, 6, 0.5)) == pytest.approx(2.0 ** -6)
    assert verdicts(decide(claims_file(tmp_path, pair("agreed", at_least=1)), table))["c"] == "contradicted"
    assert verdicts(decide(claims_file(tmp_path, pair("agreed", at_most=0)), table))["c"] == "supported"
    mixed = decide(claims_file(tmp_path, pair("mixed", at_least=1)), table)[0]
    assert mixed["verdict"] == "not resolved" and "3 of 6 meet the bound" in mixed["tests"][0]["needs"]
    few = decide(claims_file(tmp_path, pair("few", at_least=1)), table)[0]  # 2^-3 = 0.125: 3 runs cannot decide
    assert few["verdict"] == "not resolved" and "at least 6 runs" in few["tests"][0]["needs"]
    with pytest.raises(ConfigError, match="exactly one of at_least, at_most"):
        decide(claims_file(tmp_path, pair("split", at_least=1, at_most=3)), table)

"""A run's course (lab/study/trajectory.py) and the claims about it (lab/study/claims/trajectory.py), on
hand-made steps and summaries whose answers are worked out here from the definitions."""
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as st

from lab.study import claims as C
from lab.study import trajectory as T
from lab.study.claims.file import ClaimsError, validate_claims

SPEC = {"settled_after": 50, "target_train_loss": 1.0, "window": 4, "margin_log": 0.2}


def write_steps(folder, overflow_at=(10, 60, 80), grow_after=70, n=100):
    """100 steps: the scale halves after each overflow step, doubles after `grow_after`; the loss falls by 0.02 a
    step from 2.0 (an overflow step's loss is inf and it is skipped)."""
    scale, rows = 2.0 ** 16, []
    for s in range(n):
        over = s in overflow_at
        rows.append({"step": s, "loss": math.inf if over else 2.0 - 0.02 * s, "scale": scale,
                     "found_inf": int(over), "skipped": int(over)})
        scale = scale / 2 if over else scale * 2 if s == grow_after else scale
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "steps.csv", index=False)
    return pd.DataFrame(rows)


def test_settled_overflows_growths_scale_and_time_to_target(tmp_path):
    steps = write_steps(tmp_path)
    v = T.run_values(tmp_path, {"train_time_s": 12.0, "settle_time_s": 2.0}, SPEC)
    assert (v["settled_overflows"], v["settled_steps"], v["settled_growths"]) == (2, 50, 1)
    assert v["settled_scale"] == steps.loc[steps["step"] >= 50, "scale"].median()
    assert v["skipped_count"] == 3
    # applied steps' losses 2.0 - 0.02 s; the mean of the 4 ending at step s (none skipped there) is
    # 2.0 - 0.02 (s - 1.5) <= 1.0 first at s = 51.5 -> step 52, which is 53 steps
    assert v["reached_target"] and v["steps_to_target"] == 53
    assert v["seconds_to_target"] == pytest.approx(2.0 + 53 * (12.0 - 2.0) / 100)
    # a table of runs holds NaN where a run has no empty-gradient steps
    assert T.run_values(tmp_path, {"train_time_s": 12.0, "settle_time_s": float("nan")}, SPEC)[
        "seconds_to_target"] == pytest.approx(53 * 12.0 / 100)
    never = T.run_values(tmp_path, {"train_time_s": 10.0}, {**SPEC, "target_train_loss": 0.01})
    assert not never["reached_target"] and never["steps_to_target"] == 100


def test_summary_pools_seeds_with_exact_intervals(tmp_path):
    dirs = []
    for seed in (0, 1):
        write_steps(tmp_path / str(seed), overflow_at=(10, 60) if seed else (10, 60, 80))
        dirs.append(tmp_path / str(seed))
    runs = pd.DataFrame({"seed": [0, 1], "steps": [100, 100], "train_time_s": [10.0, 10.0]})
    runs = T.add_run_values(runs, dirs, SPEC)
    row = T.summary_columns(runs, 0.95)
    k, exposure = 3, 100  # 2 + 1 settled overflows in 50 + 50 steps
    assert (row["settled_overflow_count"], row["settled_exposure"]) == (k, exposure)
    lo, hi = st.chi2.ppf(0.025, 2 * k) / 2, st.chi2.ppf(0.975, 2 * k + 2) / 2  # Garwood
    assert row["settled_per_1k_low"] == pytest.approx(1000 * lo / exposure)
    assert row["settled_per_1k_high"] == pytest.approx(1000 * hi / exposure)
    assert row["settled_per_growth"] == k / 2 and row["skipped_count"] == 5 and row["skipped_exposure"] == 200
    assert json.loads(row["settled_scale_by_seed"]).keys() == {"0", "1"}


def summary(**rows) -> pd.DataFrame:
    """A summary with rows named mode -> dict of trajectory columns (model 'vlm')."""
    return pd.DataFrame([{"model": "vlm", "mode": mode, "confidence": 0.95, **cols} for mode, cols in rows.items()])


def by_seed(values) -> str:
    return json.dumps({str(i): float(v) for i, v in enumerate(values)})


@pytest.mark.parametrize("count,exposure,verdict", [(12, 2000, C.SUPPORTED), (0, 10000, C.CONTRADICTED),
                                                     (0, 500, C.NOT_RESOLVED)])
def test_settled_overflows_against_a_declared_rate(count, exposure, verdict):
    table = summary(d={"settled_overflow_count": count, "settled_exposure": exposure})
    out = C.check("settled_overflows", {"model": "vlm", "mode": "d", "at_least_per_1k": 1}, table)
    assert out.verdict == verdict
    mu = exposure / 1000  # the p-values by hand: P(X >= k) and P(X <= k) at the claimed rate's edge
    p = st.poisson.sf(count - 1, mu) if verdict == C.SUPPORTED else st.poisson.cdf(count, mu)
    assert f"{min(1, 2 * p):.2g}" in out.evidence or verdict == C.NOT_RESOLVED


def test_fewer_skips_both_ways_and_nothing_to_compare():
    body = {"left": {"model": "vlm", "mode": "r"}, "right": {"model": "vlm", "mode": "d"}}
    rows = {"r": {"skipped_count": 0, "skipped_exposure": 1600}, "d": {"skipped_count": 20, "skipped_exposure": 1600}}
    assert C.check("fewer_skips", body, summary(**rows)).verdict == C.SUPPORTED
    swapped = {"r": rows["d"], "d": rows["r"]}
    assert C.check("fewer_skips", body, summary(**swapped)).verdict == C.CONTRADICTED
    none = {m: {"skipped_count": 0, "skipped_exposure": 1600} for m in rows}
    assert C.check("fewer_skips", body, summary(**none)).verdict == C.OUT_OF_REACH


def test_time_to_target_ratio_supported_contradicted_and_no_spread():
    body = {"left": {"model": "vlm", "mode": "r"}, "right": {"model": "vlm", "mode": "d"}, "ratio": 0.63}
    right = [300, 320, 280, 310, 290, 305]
    faster = [r * f for r, f in zip(right, (0.62, 0.64, 0.63, 0.61, 0.65, 0.63))]

    def table(left):
        return summary(r={"steps_to_target_by_seed": by_seed(left), "margin_log": 0.2, "reached_target": "6/6"},
                       d={"steps_to_target_by_seed": by_seed(right), "margin_log": 0.2, "reached_target": "6/6"})
    assert C.check("time_to_target", body, table(faster)).verdict == C.SUPPORTED
    same = [r * f for r, f in zip(right, (1.01, 0.99, 1.0, 1.02, 0.98, 1.0))]
    assert C.check("time_to_target", body, table(same)).verdict == C.CONTRADICTED
    exact = [r * 0.63 for r in right]  # every seed the same ratio: a spread of zero decides nothing
    assert C.check("time_to_target", body, table(exact)).verdict == C.OUT_OF_REACH
    # faster, but by much more than claimed: not "about 37%" (TOST fails), not contradicted either
    much = [r * f for r, f in zip(right, (0.30, 0.32, 0.31, 0.29, 0.33, 0.30))]
    assert C.check("time_to_target", body, table(much)).verdict == C.NOT_RESOLVED


@pytest.mark.parametrize("scales,verdict", [([2 ** 14] * 6, C.SUPPORTED), ([2 ** 16] * 6, C.CONTRADICTED),
                                            ([2 ** 13] * 5, C.NOT_RESOLVED), ([2 ** 13] * 4 + [2 ** 16] * 2,
                                                                              C.NOT_RESOLVED)])
def test_scale_range_sign_test(scales, verdict):
    table = summary(d={"settled_scale_by_seed": by_seed(scales)})
    out = C.check("scale_range", {"model": "vlm", "mode": "d", "low": 4096, "high": 16384}, table)
    # 6 of 6: p = 1/64, x2 (Holm over its two tests) < 0.05; 5 of 5: 1/32 x 2 > 0.05
    assert out.verdict == verdict


def test_scale_range_says_how_many_seeds_a_sign_test_needs():
    claims = [{"id": f"c{i}", "text": "t", "source": "s",
               "scale_range": {"model": "vlm", "mode": "d", "low": 4096, "high": 16384}} for i in range(6)]
    records = C.evaluate(claims, summary(d={"settled_scale_by_seed": by_seed([2 ** 14] * 3)}))
    # 6 claims: Holm's first step at 0.05 / 12 one-sided; 2^-n <= 0.05 / 12 from n = 8
    assert all(r["verdict"] == C.NOT_RESOLVED and "needs 8" in r["evidence"] for r in records)


def test_bad_predicates_are_named():
    base = {"id": "x", "text": "t", "source": "s"}
    with pytest.raises(ClaimsError, match="scale_range.low must be <= high"):
        validate_claims([{**base, "scale_range": {"model": "m", "mode": "d", "low": 8, "high": 4}}])
    with pytest.raises(ClaimsError, match="time_to_target.ratio must be a positive number"):
        validate_claims([{**base, "time_to_target": {"left": {"model": "m", "mode": "a"},
                                                     "right": {"model": "m", "mode": "b"}, "ratio": 0}}])
    with pytest.raises(T.TrajectoryError, match="trajectory.window: expected an integer >= 1"):
        T.validate({"window": 0}, "f")
    assert np.isnan(T.DEFAULTS["target_train_loss"] or np.nan)

"""lab.study.stats: t intervals, pair correlation and identical-mode detection."""
import csv
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as st

from lab.study import stats as S


def t3_cdf(t):
    """Student t CDF with 3 degrees of freedom in closed form (the hand computation, independent of scipy)."""
    return 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi


def test_t_interval_hand_computed():
    mean, half = S.t_interval([1, 2, 3, 4])
    # sd = sqrt(5/3) = 1.290994, t_{0.975,3} = 3.182446, half width = 3.182446 * 1.290994 / 2 = 2.05426
    assert mean == 2.5
    assert half == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-6)
    assert half == pytest.approx(2.05426, abs=1e-5)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_t_interval_matches_scipy_ttest(confidence):
    d = np.random.default_rng(3).normal(0.2, 1.0, 7)
    mean, half = S.t_interval(d, confidence)
    ci = st.ttest_1samp(d, 0.0).confidence_interval(confidence)
    assert mean - half == pytest.approx(ci.low) and mean + half == pytest.approx(ci.high)


def test_t_interval_small_samples():
    mean, half = S.t_interval([0.3])
    assert mean == 0.3 and math.isnan(half)
    mean, half = S.t_interval([])
    assert math.isnan(mean) and math.isnan(half)
    assert S.t_interval([0.1, 0.1, 0.1]) == (pytest.approx(0.1), pytest.approx(0.0))


def test_pair_correlation():
    a, b = [0.8, 0.85, 0.9, 0.95], [0.79, 0.86, 0.88, 0.96]
    assert S.pair_correlation(a, b) == pytest.approx(st.pearsonr(a, b).statistic)
    assert math.isnan(S.pair_correlation([1, 2], [1, 2]))
    assert math.isnan(S.pair_correlation([1, 1, 1], [1, 2, 3]))


def test_paired_uses_only_shared_finite_seeds():
    runs = pd.DataFrame({
        "model": ["m"] * 7 + ["other"],
        "mode": ["fp32", "fp32", "fp32", "fp32", "x", "x", "x", "x"],
        "seed": [0, 1, 2, 3, 1, 2, 3, 0],
        "final_top1": [0.5, 0.6, 0.7, 0.8, 0.65, np.nan, 0.9, 0.1],
    })
    ref, mine = S.paired(runs, "m", "x", "final_top1")
    assert ref.tolist() == [0.6, 0.8] and mine.tolist() == [0.65, 0.9]  # seed 0 unpaired, seed 2 NaN
    ref, mine = S.paired(runs, "m", "x", "final_val_loss")  # a metric the runs predate
    assert len(ref) == len(mine) == 0


# --- identical modes -------------------------------------------------------------------------------------
def write_steps(run_dir, scales, grad_norm="1.0"):
    run_dir.mkdir(parents=True)
    with open(run_dir / "steps.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["step", "loss", "scale", "found_inf", "skipped", "grad_norm"])
        for i, s in enumerate(scales):
            w.writerow([i, f"{2.0 / (i + 1):.6f}", s, int(i == 0), int(i == 0), grad_norm])
    return run_dir


def test_identical_modes(tmp_path):
    base = ["65536.0", "32768.0", "32768.0"]
    changed = ["65536.0", "32768.0", "65536.0"]  # one scale value differs
    runs = {mode: {seed: write_steps(tmp_path / mode / str(seed), sc, gn) for seed in (0, 1)}
            for mode, sc, gn in [("fp16-dynamic", base, "1.0"), ("fp16-gradnorm", base, "2.5"),
                                 ("fp16-other", changed, "1.0"), ("fp16-fallback", base, "1.0"),
                                 ("fp16-other2", changed, "1.0")]}
    groups = S.identical_modes(runs)
    # grad_norm is not compared; each mode joins the first earlier mode it matches
    assert groups == [("fp16-dynamic", ["fp16-gradnorm", "fp16-fallback"], 2), ("fp16-other", ["fp16-other2"], 2)]


def test_identical_modes_needs_every_shared_seed_and_the_files(tmp_path):
    base, changed = ["1.0", "2.0"], ["1.0", "4.0"]
    runs = {"a": {0: write_steps(tmp_path / "a0", base), 1: write_steps(tmp_path / "a1", base)},
            "b": {0: write_steps(tmp_path / "b0", base), 1: write_steps(tmp_path / "b1", changed)},
            "c": {1: write_steps(tmp_path / "c1", base), 2: write_steps(tmp_path / "c2", changed)},
            "d": {0: tmp_path / "missing"}}
    assert S.identical_modes(runs) == [("a", ["c"], 1)]  # c shares seed 1 only; d has no steps.csv
    assert S.identical_modes({"a": runs["a"], "e": {5: write_steps(tmp_path / "e5", base)}}) == []


@pytest.mark.parametrize("count,exposure", [(0, 500), (1, 200), (3, 500), (40, 1000)])
def test_poisson_rate_interval_is_the_exact_one(count, exposure):
    """Garwood's interval, against statsmodels' exact-c (the reference implementation)."""
    from statsmodels.stats.rates import confint_poisson
    low, high = S.poisson_rate_interval(count, exposure)
    ref_low, ref_high = confint_poisson(count, exposure, method="exact-c")
    assert low == pytest.approx(ref_low, rel=1e-9, abs=1e-15) and high == pytest.approx(ref_high, rel=1e-9)
    assert high > low and low <= count / exposure <= high


def test_poisson_rate_interval_covers_at_least_its_level():
    """Exact intervals are conservative: over Poisson draws of small means (the 0-2 overflow events of a run),
    the 95% interval covers the true rate in at least 95% of draws; none has zero width."""
    rng = np.random.default_rng(0)
    for mu in (0.5, 1.0, 2.0, 5.0):
        counts = rng.poisson(mu, 4000)
        bounds = np.array([S.poisson_rate_interval(c, 1.0) for c in counts])
        assert (bounds[:, 1] > bounds[:, 0]).all()
        assert ((bounds[:, 0] <= mu) & (mu <= bounds[:, 1])).mean() >= 0.95
    assert all(np.isnan(S.poisson_rate_interval(1, 0)))

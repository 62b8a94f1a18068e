"""lab/study/inference.py against reference implementations: the pooled spread against statsmodels' OLS, the
examples' variance against a bootstrap over units, sizing against statsmodels' power solver, the spread test."""
import math

import numpy as np
import pandas as pd
import pytest
import statsmodels.formula.api as smf
from statsmodels.stats.power import TTestPower

from lab.study import inference as I


def test_anova_residual_is_the_two_way_ols_residual():
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (6, 3)) + np.arange(3)[None, :] + np.arange(6)[:, None]
    var, df = I.anova_residual(table)
    rows = [{"mode": m, "seed": s, "y": table[m, s]} for m in range(6) for s in range(3)]
    fit = smf.ols("y ~ C(mode) + C(seed)", pd.DataFrame(rows)).fit()
    assert var == pytest.approx(fit.mse_resid) and df == fit.df_resid == 10


def test_the_examples_variance_matches_a_bootstrap_over_units():
    """Units of unequal size (the LM's documents): the linearised variance of the token-weighted mean Δ agrees
    with the bootstrap variance of the ratio estimator, resampling whole units."""
    rng = np.random.default_rng(1)
    sizes = np.array([3392, 876, 608, 8369, 96, 2913, 3227, 263]) // 8
    unit = np.repeat(np.arange(8), sizes)
    d = rng.normal(0.02, 0.3, len(unit)) + rng.normal(0, 0.05, 8)[unit]
    v, n = I.example_variance(I.unit_shares(d, unit))
    a, t = np.bincount(unit, weights=d), np.bincount(unit).astype(float)
    boot = rng.integers(0, 8, (20000, 8))
    ratios = a[boot].sum(1) / t[boot].sum(1)
    assert n == 8
    assert v == pytest.approx(np.var(ratios) * 8 / 7, rel=0.2)  # the bootstrap's 1/U against 1/(U - 1)
    # one example per unit: var(d) / N
    v1, n1 = I.example_variance(I.unit_shares(d, np.arange(len(d))))
    assert n1 == len(d) and v1 == pytest.approx(np.var(d, ddof=1) / len(d))


def test_a_much_wider_mode_gets_its_own_spread_and_the_rest_are_pooled():
    rng = np.random.default_rng(2)
    values = {m: {s: rng.normal(0, 0.01) for s in range(4)} for m in ["fp32", "a", "b", "c", "d"]}
    values["wild"] = {s: values["fp32"][s] + rng.normal(0, 1.5) for s in range(4)}
    deltas, var, df, own = I.seed_spread(values, "fp32")
    assert own == {"wild"} and df == (5 - 1) * (4 - 1)
    table = np.array([[values[m][s] for s in range(4)] for m in ["fp32", "a", "b", "c", "d"]])
    assert var == pytest.approx(2 * I.anova_residual(table)[0])
    cells = I.family_cells(values, {}, "fp32", 0.1)
    assert cells["wild"].spread == "own" and cells["wild"].df == 3
    assert cells["a"].spread == "pooled" and cells["a"].df == 12


def test_below_four_seeds_every_mode_keeps_its_own_spread():
    """At 2-3 seeds no test can tell a 10x wider mode from the rest, so none is pooled."""
    rng = np.random.default_rng(2)
    values = {m: {s: rng.normal(0, 0.01) for s in range(3)} for m in ["fp32", "a", "b", "c"]}
    cells = I.family_cells(values, {}, "fp32", 0.1)
    assert {c.spread for c in cells.values()} == {"own"} and {c.df for c in cells.values()} == {2}


def test_a_zero_spread_is_not_an_interval():
    values = {"fp32": {0: 0.9, 1: 0.8}, "m": {0: 0.9 - 1 / 360, 1: 0.8 - 1 / 360}}
    cell = I.family_cells(values, {}, "fp32", 0.01)["m"]
    assert cell.spread == "zero" and math.isnan(cell.p_diff) and not cell.decidable and "no spread" in cell.note
    same = I.family_cells(values, {"m": (np.zeros(360), True, 0)}, "fp32", 0.01)["m"]
    assert same.spread == "identical"
    [(verdict, _, _)] = I.decide_table([same], 0.05, [True])
    assert verdict == "identical"


@pytest.mark.parametrize("effect, var", [(0.5, 1.0), (0.1, 0.04), (0.02, 0.0009)])
def test_seeds_for_matches_statsmodels_without_example_noise(effect, var):
    n = I.seeds_for(effect, var, 0.0, 0.05, 0.8)
    ref = math.ceil(TTestPower().solve_power(effect_size=effect / math.sqrt(var), alpha=0.05, power=0.8))
    assert n == max(2, ref)


def test_seeds_are_a_range_and_the_test_set_can_put_an_effect_out_of_reach():
    lo, hi = I.seeds_range(0.1, 0.04, 7, 0.0, 0.05, 0.8)
    assert 2 <= lo < hi < math.inf  # the upper 90% bound of an sd from 7 degrees of freedom asks more seeds
    assert I.seeds_for(0.01, 0.04, (0.01) ** 2, 0.05, 0.8) == math.inf  # examples' sd = the effect: no seeds do it
    # beyond the cap (a number exists) is not the test set's floor (no number does)
    assert I.seeds_for(0.001, 0.04, 0.0, 0.05, 0.8) == 1001 and I.fmt_seeds((3, 1001)) == "3–more than 1000"
    assert I.fmt_seeds((4, 9)) == "4–9" and I.fmt_seeds((3, math.inf)).startswith("3–none suffices")
    # sized at BH's first step: 34 tests ask for more seeds than one test at 5%
    n34 = I.seeds_for(0.1, 0.04, 0.0, I.sizing_alpha(0.05, 34), 0.8)
    assert n34 > I.seeds_for(0.1, 0.04, 0.0, 0.05, 0.8) and I.sizing_alpha(0.05, 34) == pytest.approx(0.05 / 34)


def test_identical_means_the_same_outputs_not_the_same_right_wrong_vector():
    """Two runs that get the same images right but with other losses are not identical, for either
    metric; only a bit-for-bit equal evaluation (correctness and loss of every example) is."""
    from lab.study.verdicts import family_inputs
    rng = np.random.default_rng(0)
    correct = rng.random(50) < 0.8
    loss = rng.random(50)

    def out(l):
        return {"correct": correct, "loss": l, "unit": np.arange(50)}
    rows = [{"mode": m, "seed": s} for m in ("fp32", "m") for s in (0, 1)]
    same = [out(loss)] * 4
    other = [out(loss)] * 2 + [out(loss + 1e-3)] * 2
    for metric in ("top1", "val_loss"):
        assert family_inputs(rows, same, metric, "fp32")[1]["m"][1] is True
        assert family_inputs(rows, other, metric, "fp32")[1]["m"][1] is False

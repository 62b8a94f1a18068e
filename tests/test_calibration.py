"""The verdict procedure calibrated by simulation (lab/study/calibration.py), on the study's own structure: the
families, modes and seeds of configs/default.yaml, 360 images with whole-image top-1 and ties, the LM's next tokens
in their real, unequal validation documents; each family's fp16-noscale 3, 5 or 10x wider than its other modes (the
LM's 150x). Under no true difference each verdict's false-resolution rate stays at or under its declared level within
Monte Carlo error, with and without a mode x example interaction; a seed spread of zero decides nothing; a planted
effect is found; and breaking the procedure (no zero-spread guard, no multiplicity control, no test of comparable
spreads, the examples' shared variance dropped) fails these checks.

The simulations use fixed seeds, so each check gives the same numbers on every run (no retrying into green); the
margins below are 3 Monte Carlo standard errors of the rate."""
import math

import numpy as np
import pytest

from lab.study import calibration, inference

# a simulation study of the procedure (~100 s of CPU): `make test-studies`, which CI runs after the suite
pytestmark = pytest.mark.study

ALPHA = 0.05
NULL_REPS = 200


def mc_bound(n: int, level: float = ALPHA) -> float:
    """The level plus 3 Monte Carlo standard errors of a rate estimated from n trials."""
    return level + 3 * math.sqrt(level * (1 - level) / n)


def null_failures(rates: dict) -> list[str]:
    """The checks a null simulation must pass, as the list of those it failed."""
    failed = []
    if rates["cell_ordinary"] > mc_bound(rates["n_ordinary"]):
        failed.append(f"ordinary cells resolve {rates['cell_ordinary']:.3f} of the time")
    if rates["cell_wild"] > mc_bound(rates["n_wild"]):
        failed.append(f"the wide-spread mode's cells resolve {rates['cell_wild']:.3f} of the time")
    if rates["study_any"] > mc_bound(rates["reps"]):
        failed.append(f"{rates['study_any']:.3f} of null studies resolve some cell after the table's control")
    return failed


def zero_spread_failures(tie: dict, fixed: dict) -> list[str]:
    """A spread of zero decides nothing: neither two seeds that tie in whole images, nor modes whose every seed
    differs from FP32 by the same examples (the seed spread pooled over the family is zero, or rounding)."""
    failed = []
    if tie["tied"] < 30:
        failed.append(f"only {tie['tied']} tied draws: the scenario does not test the guard")
    if tie["resolved"]:
        failed.append(f"{tie['resolved']} of {tie['tied']} tied draws resolved")
    if fixed["decided"]:
        failed.append(f"{fixed['decided']} of {fixed['cells']} zero-spread cells decided")
    return failed


def families(wide: float = 10.0, interaction: float = 0.0):
    return calibration.study_families(None, wide=wide, interaction=interaction)


def test_the_simulation_has_the_study_shape():
    """The default study's families, modes and seeds, and the LM's validation documents as the data splits them."""
    from lab.core.config import load_study
    from lab.core.study import family_seeds
    study, fams = load_study(None), {f.name: f for f in families()}
    assert set(fams) == set(study["models"])
    for name, spec in study["models"].items():
        assert fams[name].modes == len(spec.get("modes") or study["modes"])
        assert fams[name].seeds == len(family_seeds(study, name))
    sizes = np.array(fams["lm"].unit_sizes)
    assert len(sizes) > 8 and sizes.max() > 3 * np.median(sizes)   # unequal documents, not equal blocks


@pytest.mark.parametrize("wide", [3.0, 5.0, 10.0])
def test_no_false_resolutions_beyond_the_declared_level(wide):
    null = calibration.null_rates(NULL_REPS, families(wide), seed=11)
    assert null["n_wild"] > 1.9 * NULL_REPS * len(families()) and null["n_ordinary"] > 30 * NULL_REPS
    assert null_failures(null) == []


@pytest.fixture(scope="module")
def null_interaction():
    return calibration.null_rates(NULL_REPS, families(interaction=calibration.INTERACTION_SD), seed=13)


def test_a_mode_by_example_interaction_keeps_the_level(null_interaction):
    """With each mode shifting each example its own way on every seed, the test set's sample is shared by
    the seeds; the crossed model keeps that part (the covariance of the per-unit Δs across seeds) in the interval."""
    assert null_failures(null_interaction) == []


def test_a_zero_seed_spread_resolves_nothing():
    assert zero_spread_failures(calibration.tie_rate(3000, seed=2), calibration.fixed_shift_rate(60, seed=5)) == []


def test_a_planted_effect_is_found():
    """A validation-loss gain of ~0.004 nats on one ordinary LM mode (a tenth of the LM's declared margin, in a family
    whose ordinary modes barely differ, as the LM's do) is resolved in most simulated studies, after BH over the
    table."""
    power, delta = calibration.power(100, 0.02, families(), seed=3, mode=2)
    assert -0.006 < delta < -0.002
    assert power >= 0.7


def test_breaking_the_procedure_fails_the_calibration(monkeypatch):
    """Each mutation of the procedure below makes one of the checks above fail."""
    with monkeypatch.context() as m:  # no zero-spread guard: a zero seed spread decides on the examples alone
        m.setattr(inference, "zero_spread", lambda var, scale: False)
        assert zero_spread_failures(calibration.tie_rate(3000, seed=2), calibration.fixed_shift_rate(60, seed=5))
    with monkeypatch.context() as m:  # no multiplicity control across the table
        m.setattr(inference, "bh_adjust", lambda p: np.asarray(p, float))
        rates = calibration.null_rates(80, families(), seed=11)
        assert any("after the table's control" in f for f in null_failures(rates))
    with monkeypatch.context() as m:  # the examples' shared variance scaled away: the interaction reads as signal
        m.setattr(inference, "fixed_example_variance", lambda shares, f=inference.fixed_example_variance:
                  f(shares) * 1e-12)
        rates = calibration.null_rates(80, families(interaction=calibration.INTERACTION_SD), seed=13)
        assert null_failures(rates)
    with monkeypatch.context() as m:  # no test of comparable spreads: the wide mode pooled with the rest
        m.setattr(inference, "larger_spread_modes", lambda deltas, level=inference.SPREAD_TEST_LEVEL: set())
        # 80 studies, as above, not NULL_REPS: at 10x this mutant resolves several times the bound of the wide
        # mode's null cells, so the smaller simulation still fails it
        rates = calibration.null_rates(80, families(), seed=11)
        assert any("wide-spread mode" in f for f in null_failures(rates))


# --- through the study's own commands (lab/study/calibration_runs.py) ------------------------------------------
RUNS_REPS = 10   # 2-3 s each: a check for gross failures here; benchmarks/calibration/calibrate_study_runs.py measures the rates


@pytest.fixture(scope="module")
def study():
    from lab.core.config import load_study
    return load_study(None)


def runs_failures(rates: dict) -> list[str]:
    failed = []
    for key, n in (("cell_ordinary", rates["n_ordinary"]), ("cell_wide", rates["n_wide"]),
                   ("table_any", rates["reps"]), ("claims_any", rates["reps"]), ("compare_any", rates["reps"])):
        if rates[key] > mc_bound(n):
            failed.append(f"{key} {rates[key]:.3f} over {mc_bound(n):.3f}")
    return failed


def test_null_studies_shaped_like_the_config_through_aggregate_claims_and_compare(study):
    """The study's families, modes, seeds and validation units (the LM's 8 unequal documents), fp16-noscale 10x wider
    than the other modes, written as run directories and run through aggregate, claims (the study's claims file,
    margins and sequential plan) and compare: no false resolution beyond the declared levels."""
    from lab.study import calibration_runs
    rates = calibration_runs.null_rates(RUNS_REPS, study, "configs/claims.yaml", seed=7, wide=10.0)
    assert rates["n_wide"] > 0 and rates["n_ordinary"] > 30 * RUNS_REPS
    assert runs_failures(rates) == []


def test_the_commands_without_multiplicity_control_fail_it(study, monkeypatch):
    from lab.study import calibration_runs
    monkeypatch.setattr(inference, "bh_adjust", lambda p: np.asarray(p, float))
    rates = calibration_runs.null_rates(8, study, "configs/claims.yaml", seed=7, wide=10.0)
    assert any(f.startswith("table_any") for f in runs_failures(rates))


def tost_rate_at_margin(reps: int = 4000, seed: int = 5, s: int = 2, df: int = 10, margin: float = 0.05) -> float:
    """How often TOST declares equivalence when the true difference sits exactly on the margin: seed Δs drawn at
    Δ = margin, the pooled spread estimated on ``df`` degrees of freedom (a family's pool), as decide_cell uses it."""
    rng = np.random.default_rng(seed)
    sd = 0.03
    hits = 0
    for _ in range(reps):
        d = rng.normal(margin, sd, s)
        var = sd ** 2 * rng.chisquare(df) / df   # the pooled estimate of var(Δ) per seed
        cell = inference.decide_cell(inference.Paired(d), var, df, "pooled", margin)
        hits += math.isfinite(cell.p_tost) and cell.p_tost <= ALPHA
    return hits / reps


def test_equivalence_at_the_margin_holds_its_level(monkeypatch):
    """TOST's error where it matters most, a true difference equal to the margin: at most 5% (within
    Monte Carlo error); taking the smaller of its two one-sided p-values instead of the larger breaks it."""
    assert tost_rate_at_margin() <= mc_bound(4000)
    monkeypatch.setattr(inference, "max", min, raising=False)  # TOST with min(p_lo, p_hi): the broken version
    assert tost_rate_at_margin(reps=1000) > mc_bound(1000)

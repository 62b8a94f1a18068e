"""The claims engine's `trend` and `differs` kinds (lab/study/claims/runs.py; configs/claims_long_context.yaml): a
trend across families decided from each seed's slope, and a difference between two modes contradicted by construction
when they computed the same numbers, on tables built to decide them."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from lab.study.claims import ClaimsError, evaluate, load_file

MODELS = [f"ctx{2 ** k}" for k in range(5, 11)]


def claims_file(tmp_path, claims):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": [{"text": "t", "source": "s", **c} for c in claims]}))
    return load_file(path, reads="runs")


def table(values, mode="m", column="x"):
    """values[seed][model index] -> a runs table of one mode over MODELS."""
    return pd.DataFrame([{"model": MODELS[i], "mode": mode, "seed": s, column: v}
                         for s, row in enumerate(values) for i, v in enumerate(row)])


def trend(is_="increasing", effect=0.5, **more):
    return {"trend": {"column": "x", "mode": "m", "models": MODELS, "is": is_, "effect": effect, **more}}


def verdict(tmp_path, claim, runs):
    return evaluate(claims_file(tmp_path, [{"id": "c", **claim}]), {"runs": runs})[0]


def test_a_steady_doubling_is_supported_and_its_slope_is_the_one_built_in(tmp_path):
    rng = np.random.default_rng(0)
    x = np.arange(6)
    values = [2.0 ** (1.0 * x + rng.normal(0, 0.05, 6)) * 1e-3 for _ in range(4)]
    got = verdict(tmp_path, trend(), table(values))
    assert got["verdict"] == "supported"
    slope = float(got["tests"][0]["estimate"].split()[1])
    assert slope == pytest.approx(1.0, abs=0.05)
    assert verdict(tmp_path, trend("decreasing"), table(values))["verdict"] == "contradicted"


def test_a_flat_number_contradicts_growth_and_a_noisy_one_is_sized(tmp_path):
    rng = np.random.default_rng(1)
    flat = [1e-4 * 2.0 ** rng.normal(0, 0.05, 6) for _ in range(4)]
    assert verdict(tmp_path, trend(), table(flat))["verdict"] == "contradicted"
    noisy = [1e-4 * 2.0 ** rng.normal(0, 2.0, 6) for _ in range(4)]
    got = verdict(tmp_path, trend(), table(noisy))
    assert got["verdict"] in ("not resolved", "out of reach") and "seeds" in got["tests"][0]["needs"]


def test_a_slope_in_the_column_itself_and_a_value_with_no_logarithm(tmp_path):
    values = [[0.0, 0.1, 0.2, 0.3, 0.4, 0.5 + 0.01 * s] for s in range(4)]
    assert verdict(tmp_path, trend(effect=0.05, log=False), table(values))["verdict"] == "supported"
    got = verdict(tmp_path, trend(), table(values))
    assert got["verdict"] == "not resolved" and "logarithm" in got["evidence"]


def test_only_seeds_that_trained_every_family_count(tmp_path):
    values = [2.0 ** (np.arange(6) + 0.01 * s) for s in range(3)]
    runs = table(values)
    runs = runs[~((runs.seed == 2) & (runs.model == MODELS[-1]))]  # seed 2 lacks the longest context
    got = verdict(tmp_path, trend(), runs)
    assert "2 seeds" in got["tests"][0]["estimate"]


def test_differs_is_contradicted_by_identical_runs_and_supported_by_a_real_difference(tmp_path):
    rng = np.random.default_rng(2)
    a = rng.normal(3.0, 0.1, 4)
    runs = pd.DataFrame([{"model": "lm", "mode": mode, "seed": s, "x": a[s] + shift, "y": 1.0}
                         for mode, shift in (("plain", 0.0), ("same", 0.0)) for s in range(4)])
    claim = {"differs": {"model": "lm", "columns": ["x", "y"], "left": "same", "right": "plain"}}
    got = verdict(tmp_path, claim, runs)
    assert got["verdict"] == "contradicted" and "identical bit for bit" in got["tests"][0]["estimate"]
    other = runs[runs["mode"] == "plain"].assign(mode="other", x=a + 0.5 + rng.normal(0, 0.01, 4))
    claim = {"differs": {"model": "lm", "columns": ["x"], "left": "other", "right": "plain"}}
    assert verdict(tmp_path, claim, pd.concat([runs, other]))["verdict"] == "supported"


def test_differs_needs_every_column_equal_and_two_seeds(tmp_path):
    runs = pd.DataFrame([{"model": "lm", "mode": mode, "seed": s, "x": 1.0 + s, "y": (1.0 if mode == "a" else 1.0
                                                                                        + 1e-15 * (s + 1))}
                         for mode in ("a", "b") for s in range(4)])
    claim = {"differs": {"columns": ["x", "y"], "left": "b", "right": "a"}}
    assert verdict(tmp_path, claim, runs)["verdict"] != "contradicted"   # y differs in its last bits
    one = runs[runs.seed == 0]
    assert verdict(tmp_path, {"differs": {"columns": ["x"], "left": "b", "right": "a"}}, one)["verdict"] \
        != "contradicted"


def test_a_bad_trend_is_named(tmp_path):
    with pytest.raises(ClaimsError, match="trend.is"):
        evaluate(claims_file(tmp_path, [{"id": "c", **trend("upwards")}]), {"runs": table([[1.0] * 6] * 3)})

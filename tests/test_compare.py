"""`python -m lab compare` (lab/study/compare.py): two modes on the same seeds, counts by an exact Poisson test,
the rest with the pooled interval, Benjamini–Hochberg over the table; the config's `compare:` pairs are checked
against its modes."""
import copy
import json
import math

import pandas as pd
import pytest
from scipy import stats as st

from conftest import tiny_study
from lab.cli import main
from lab.core.config import ConfigError, validate_study
from lab.study.compare import compare_modes, comparison_markdown


def runs_frame(dyn_training=(1, 0, 2)):
    rows = []
    for seed, (dyn, amax) in enumerate(zip(dyn_training, (0, 1, 0))):
        for mode, initial, training, loss in (("fp16-dynamic", 4, dyn, 1.0 + seed), ("fp16-amax", 0, amax, 1.1 + seed)):
            rows.append(dict(model="mobilenetv2", mode=mode, seed=seed, overflow_initial=initial,
                             overflow_in_training=training, skipped_steps=initial + training,
                             overflow_steps=initial + training, steps_after_first_clean=200 - initial,
                             flushed_param=0.001 * seed, flushed_activation=None, final_val_loss=loss))
    rows.append(dict(model="mobilenetv2", mode="fp16-amax", seed=9, overflow_initial=0, overflow_in_training=100,
                     skipped_steps=100, overflow_steps=100, steps_after_first_clean=200,
                     flushed_param=0.5, flushed_activation=None, final_val_loss=9.0))  # no pair: left out
    return pd.DataFrame(rows)


def test_overflows_counted_once_the_descent_shown_untested_training_by_the_exact_poisson_test():
    t = compare_modes(runs_frame(), "fp16-amax", "fp16-dynamic").set_index("metric")
    assert "skipped_steps" not in t.index and "overflow_steps" not in t.index  # the same events: tested once
    descent = t.loc["overflow_initial"]   # GradScaler's halvings from 2^16: arithmetic, not a rate
    assert descent["delta"] == pytest.approx(-4) and math.isnan(descent["p"]) and math.isnan(descent["q"])
    row = t.loc["overflow_in_training"]
    # 1 overflow of fp16-amax over 600 steps against 3 of fp16-dynamic over 588: given 4 in all, fp16-amax's count
    # is binomial(4, 600/1188) under equal rates (scipy, here); two-sided: twice the smaller tail
    k, n, share = 1, 4, 600 / 1188
    p = min(1.0, 2 * min(st.binom.cdf(k, n, share), st.binom.sf(k - 1, n, share)))
    assert row["n_pairs"] == 3 and row["delta"] == pytest.approx((1 - 3) / 3)
    assert row["p"] == pytest.approx(p) and math.isnan(row["delta_ci"])
    # the loss differs by exactly 0.1 on every seed: a spread of zero decides nothing (no interval, not resolved)
    loss = t.loc["final_val_loss"]
    assert loss["delta"] == pytest.approx(0.1) and math.isnan(loss["delta_ci"]) and not loss["resolved"]
    assert "flushed_activation" not in t.index  # no values: no row
    # Benjamini–Hochberg over the table's tests (the descent is none of them), written out
    ps = t["p"].dropna().sort_values()
    m = len(ps)
    q = (ps * m / pd.Series(range(1, m + 1), index=ps.index))[::-1].cummin()[::-1].clip(upper=1)
    assert t.loc[q.index, "q"].to_numpy() == pytest.approx(q.to_numpy())
    assert row["resolved"] == (row["q"] <= 0.05)
    md = comparison_markdown(compare_modes(runs_frame(), "fp16-amax", "fp16-dynamic"))
    assert md.startswith("| fp16-amax − fp16-dynamic | mobilenetv2 |") and "overflows in training" in md
    assert "initial descent (not tested)" in md and "false discovery rate 5% (Benjamini–Hochberg)" in md


def test_overdispersed_counts_are_not_tested_as_poisson():
    """0, 0 and 30 overflows on three seeds of equal length: far more spread than one Poisson rate gives (Pearson's
    χ² 60 on 2 df): a Poisson test would read the seeds' variation as precision."""
    t = compare_modes(runs_frame(dyn_training=(0, 0, 30)), "fp16-amax", "fp16-dynamic").set_index("metric")
    row = t.loc["overflow_in_training"]
    assert math.isnan(row["p"]) and not row["resolved"] and "overdispersed" in row["note"]
    assert row["overdispersion_p"] < 1e-6
    assert "(overdispersed: not tested)" in comparison_markdown(
        compare_modes(runs_frame(dyn_training=(0, 0, 30)), "fp16-amax", "fp16-dynamic"))


def test_cli_compare_writes_and_refuses(tmp_path, capsys):
    for i, r in runs_frame().iterrows():
        d = tmp_path / "runs" / r["model"] / r["mode"] / f"seed{r['seed']}"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                    for k, v in r.to_dict().items()}))
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- compare:start -->\nSTALE\n<!-- compare:end -->\nb\n")
    assert main(["compare", str(tmp_path), "--left", "fp16-amax", "--right", "fp16-dynamic",
                 "--md", str(tmp_path / "c.md"), "--readme", str(readme)]) == 0
    assert "STALE" not in readme.read_text() and (tmp_path / "c.md").read_text().strip() in readme.read_text()
    assert main(["compare", str(tmp_path), "--left", "fp16-nope", "--right", "fp16-dynamic"]) == 2
    assert "fp16-nope" in capsys.readouterr().err


def test_config_compare_pairs_must_name_modes():
    study = copy.deepcopy(tiny_study())
    study["compare"] = [["fp16-static128", "fp32"]]
    validate_study(copy.deepcopy(study))
    study["compare"] = [["fp16-static129", "fp32"]]
    with pytest.raises(ConfigError, match=r"compare\[0\].*fp16-static129.*did you mean 'fp16-static128'"):
        validate_study(study)

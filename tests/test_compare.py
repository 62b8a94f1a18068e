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


def runs_frame():
    rows = []
    for seed, (dyn, amax) in enumerate([(5, 0), (4, 1), (7, 0)]):
        for mode, skipped, loss in (("fp16-dynamic", dyn, 1.0 + seed), ("fp16-amax", amax, 1.1 + seed)):
            rows.append(dict(model="mobilenetv2", mode=mode, seed=seed, skipped_steps=skipped, overflow_steps=skipped,
                             flushed_param=0.001 * seed, flushed_activation=None, final_val_loss=loss))
    rows.append(dict(model="mobilenetv2", mode="fp16-amax", seed=9, skipped_steps=100, overflow_steps=0,
                     flushed_param=0.5, flushed_activation=None, final_val_loss=9.0))  # no pair: left out
    return pd.DataFrame(rows)


def test_counts_by_the_exact_poisson_test_and_no_zero_width_interval():
    t = compare_modes(runs_frame(), "fp16-amax", "fp16-dynamic").set_index("metric")
    row = t.loc["skipped_steps"]
    # 1 skipped step of fp16-amax against 16 of fp16-dynamic over the same 3 seeds (no step counts: exposure 3
    # runs each); given 17 in all, fp16-amax's count is binomial(17, 1/2) under equal rates (scipy, here)
    p = st.binomtest(1, 17, 0.5).pvalue
    assert row["n_pairs"] == 3 and row["delta"] == pytest.approx((1 - 16) / 3)
    assert row["p"] == pytest.approx(p) and math.isnan(row["delta_ci"])
    # the loss differs by exactly 0.1 on every seed: a spread of zero decides nothing (no interval, not resolved)
    loss = t.loc["final_val_loss"]
    assert loss["delta"] == pytest.approx(0.1) and math.isnan(loss["delta_ci"]) and not loss["resolved"]
    assert "flushed_activation" not in t.index  # no values: no row
    # Benjamini–Hochberg over the table's tests, written out
    ps = t["p"].dropna().sort_values()
    m = len(ps)
    q = (ps * m / pd.Series(range(1, m + 1), index=ps.index))[::-1].cummin()[::-1].clip(upper=1)
    assert t.loc[q.index, "q"].to_numpy() == pytest.approx(q.to_numpy())
    assert row["resolved"] == (row["q"] <= 0.05)
    md = comparison_markdown(compare_modes(runs_frame(), "fp16-amax", "fp16-dynamic"))
    assert md.startswith("| fp16-amax − fp16-dynamic | mobilenetv2 |") and "skipped steps" in md
    assert "false discovery rate 5% (Benjamini–Hochberg)" in md


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

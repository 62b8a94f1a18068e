"""One claims engine for every study (lab/study/claims.py): a kind registered once (claims_base.register) is usable
from a default-style claims file (the summary's cells) and an RL-style one (a per-run table), and a file that mixes
both tables is one Holm family."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from lab.study import claims as C
from lab.study import claims_base as B


@pytest.fixture
def mean_above():
    """A new kind in one function and one registry line per table: a column's mean above a bound, a one-sample t
    over the rows of one mode (summary: the row's mean, sd and seeds; runs: the runs themselves)."""
    def on_runs(body, tables, reach):
        x = tables["runs"].query("mode == @body['mode']")[body["column"]].to_numpy(float)
        t = (x.mean() - body["above"]) / (x.std(ddof=1) / math.sqrt(len(x)))
        return B.Test(float(st.t.sf(t, len(x) - 1)), math.nan, f"mean {x.mean():.3g} over {len(x)} runs",
                    one_sided=True, what=f"{body['mode']} {body['column']} > {body['above']:g}")

    def on_summary(body, tables, reach):
        row = tables["summary"].query("mode == @body['mode']").iloc[0]
        t = (row[body["column"]] - body["above"]) / (row[f"{body['column']}_sd"] / math.sqrt(row["n_seeds"]))
        n = row["n_seeds"] - 1
        return B.Test(float(st.t.sf(t, n)), float(st.t.cdf(t, n)), f"mean {row[body['column']]:.3g}")

    keys = {"mode", "column", "above"}
    B.register("mean_above", "runs", keys, family="one-sided")(on_runs)
    B.register("mean_above", "summary", keys, needs=lambda kind, body, summary, reach: "a one-sample t")(on_summary)
    yield
    for table in ("runs", "summary"):
        B.REGISTRY.pop((table, "mean_above"))


def runs_table(n=10):
    rng = np.random.default_rng(0)
    return pd.DataFrame({"mode": ["a"] * n + ["b"] * n, "seed": list(range(n)) * 2,
                         "x": np.r_[rng.normal(1.0, 0.1, n), rng.normal(0.0, 0.1, n)]})


SUMMARY = pd.DataFrame({"model": ["m", "m"], "mode": ["a", "b"], "x": [1.0, 0.0], "x_sd": [0.1, 0.1],
                        "n_seeds": [10, 10]})
CLAIM = {"text": "t", "source": "s"}


def write(tmp_path, data):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_registered_kind_serves_an_rl_style_file_and_a_default_style_one(tmp_path, mean_above):
    rl = write(tmp_path, {"alpha": 0.05, "claims": [
        {"id": "up", **CLAIM, "mean_above": {"mode": "a", "column": "x", "above": 0.5}},
        {"id": "flat", **CLAIM, "all": [{"mean_above": {"mode": "b", "column": "x", "above": 0.5}},
                                        {"order": {"column": "x", "modes": ["b", "a"]}}]}]})
    got = {r["id"]: r for r in C.evaluate(C.load_file(rl, reads="runs"), {"runs": runs_table()})}
    assert got["up"]["verdict"] == C.SUPPORTED and got["flat"]["verdict"] == C.NOT_RESOLVED
    assert len(got["flat"]["tests"]) == 2      # `all` on the runs table: its parts are tests of the family

    default = write(tmp_path, [{"id": "up", **CLAIM, "mean_above": {"mode": "a", "column": "x", "above": 0.5}},
                               {"id": "down", **CLAIM, "mean_above": {"mode": "b", "column": "x", "above": 0.5}}])
    got = {r["id"]: r for r in C.evaluate(C.load_claims(default), SUMMARY)}
    assert got["up"]["verdict"] == C.SUPPORTED and got["down"]["verdict"] == C.CONTRADICTED
    assert got["up"]["needs"] == "a one-sample t"
    assert "| **supported** |" in C.to_markdown(list(got.values()))


def test_one_file_reads_both_tables_as_one_holm_family(tmp_path, mean_above):
    mixed = write(tmp_path, {"claims": [
        {"id": "cells", **CLAIM, "mean_above": {"mode": "a", "column": "x", "above": 0.5}},
        {"id": "runs", **CLAIM, "reads": "runs", "mean_above": {"mode": "a", "column": "x", "above": 0.5}},
        {"id": "paired", **CLAIM, "reads": "runs", "requires": "runs",
         "compare": {"column": "x", "left": "b", "is": "smaller", "right": "a", "effect": 0.5}}]})
    cfg = C.load_file(mixed)
    records = C.evaluate(cfg, {"summary": SUMMARY, "runs": runs_table()})
    assert [r["verdict"] for r in records] == [C.SUPPORTED] * 3
    # the family: two p-values for the summary kind, one for each runs kind: Holm over four
    alone = C.evaluate({**cfg, "claims": cfg["claims"][1:2]}, {"runs": runs_table()})[0]["tests"][0]
    assert records[1]["tests"][0]["p_holm"] >= alone["p_holm"]
    with pytest.raises(C.ClaimsError, match="claim runs: reads the runs table, which was not given"):
        C.evaluate(cfg, {"summary": SUMMARY})


def test_a_kind_on_the_wrong_table_names_the_claim_and_the_table(tmp_path, mean_above):
    path = write(tmp_path, {"claims": [{"id": "o", **CLAIM, "order": {"column": "x", "modes": ["a", "b"]}}]})
    with pytest.raises(C.ClaimsError, match="claim o: unknown predicate kind 'order'.*the summary table's kinds"):
        C.load_file(path)
    assert C.load_file(path, reads="runs")["claims"][0]["id"] == "o"
    with pytest.raises(C.ClaimsError, match="reads: 'cells' is not allowed; allowed: summary, runs"):
        C.load_file(write(tmp_path, {"reads": "cells", "claims": [{"id": "o", **CLAIM, "cost": {}}]}))

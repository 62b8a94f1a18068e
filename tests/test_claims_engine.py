"""One claims engine for every study (lab/study/claims/): a kind registered once (lab.study.claims.base.register) is usable
from a default-style claims file (the summary's cells) and an RL-style one (a per-run table), and a file that mixes
both tables is one Holm family."""
from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from lab.study import claims as C
from lab.study.claims import base as B


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


# --- the per-run table every study's aggregate writes (lab/study/runs_table.py), and claims on it beside the summary's


def metrics_rows():
    """metrics.json rows of a default-study-like LM: two modes x three seeds, a census share, a flag, a string, a
    diverged run and a failed one."""
    rows = []
    for mode, flushed in (("fp16-dynamic", 9e-4), ("fp16-pertensor", 4e-4)):
        for seed, wobble in zip((12, 13, 14), (0.0, 3e-5, -3e-5)):  # pertensor - dynamic: -0.05 pp, a spread
            rows.append({"model": "lm", "mode": mode, "seed": seed, "precision": "fp16", "status": "ok",
                         "final_val_loss": 3.0 + seed / 1000, "final_top1": 0.4, "num_classes": 1024,
                         "train_time_s": 9.0, "tf32": False,
                         "flushed_activation": flushed + seed * 1e-6 + (wobble if mode == "fp16-pertensor" else 0),
                         "config_hash": "abc", "first_overflow_step": None if seed == 12 else 7, "diverged": False,
                         "outcomes": {"loss": [1.0]}})
    rows[1].update(status="diverged", diverged=True, final_val_loss=math.nan)
    rows.append({**rows[0], "seed": 15, "status": "failed"})
    return pd.DataFrame(rows)


def test_the_runs_table_has_a_row_per_finished_run_and_every_number_of_its_metrics():
    from lab.study.runs_table import RUN_COLUMNS, runs_table
    t = runs_table(metrics_rows())
    assert list(t.columns[:len(RUN_COLUMNS)]) == RUN_COLUMNS      # the recipe study's columns first, as before
    assert list(t.columns[len(RUN_COLUMNS):]) == ["num_classes", "flushed_activation", "first_overflow_step"]
    assert len(t) == 6 and 15 not in set(t["seed"])               # the failed run is no result
    dead = t[(t["mode"] == "fp16-dynamic") & (t["seed"] == 13)].iloc[0]
    assert dead["diverged"] == 1 and dead["val_loss"] == pytest.approx(math.log(1024))  # counts as the uniform guess
    assert t["recipe"].eq("fp16").all() and t["flushed_activation"].notna().all()
    # older metrics.json without a status: its diverged flag says it
    old = metrics_rows().drop(columns="status")
    assert runs_table(old[old["seed"] != 15])["diverged"].sum() == 1


def test_aggregate_writes_the_runs_table_that_lab_claims_reads_beside_the_summary(tmp_path, monkeypatch):
    """A summary-reading claims file (configs/claims.yaml) with one claim on the per-run table: `lab claims` finds
    runs.csv beside the summary; without it the claim is refused by name (never decided on a missing table)."""
    import json
    from lab import cli
    from lab.study.aggregate import aggregate
    dirs = []
    for _, row in metrics_rows().iterrows():
        if row["status"] == "failed":
            continue
        d = tmp_path / "runs" / row["mode"] / f"seed{row['seed']}"
        d.mkdir(parents=True)
        m = {**row.to_dict(), "scaler": "dynamic", "device_name": "cpu", "fp16_path": "n/a", "final_train_loss": 3.1,
             "overflow_steps": 0, "skipped_steps": 0, "steps": 300, "update_ratio": 1.0, "final_scale": 65536.0,
             "min_scale": 65536.0, "max_scale": 65536.0, "throughput_samples_per_s": 100.0, "peak_memory_mb": 1.0,
             "activation_mb": 1.0}
        (d / "metrics.json").write_text(json.dumps(m))
        dirs.append(d)
        if row["mode"] == "fp16-dynamic":  # the reference the summary's cells are differences from
            d = tmp_path / "runs" / "fp32" / f"seed{row['seed']}"
            d.mkdir(parents=True)
            (d / "metrics.json").write_text(json.dumps({**m, "mode": "fp32", "precision": "fp32", "scaler": "none",
                                                        "status": "ok", "diverged": False, "final_val_loss": 3.0}))
            dirs.append(d)
    tables = tmp_path / "tables"
    aggregate(dirs, tables / "summary.csv", tables / "summary.md", runs_csv=tables / "runs.csv")
    runs = pd.read_csv(tables / "runs.csv")
    assert len(runs) == 9 and runs["flushed_activation"].notna().all()
    claims = write(tmp_path, {"claims": [
        {"id": "flushes-less", **CLAIM, "reads": "runs",
         "compare": {"model": "lm", "column": "flushed_activation", "left": "fp16-pertensor", "is": "smaller",
                     "right": "fp16-dynamic", "effect": 2e-4}},
        {"id": "cells", **CLAIM, "bound": {"model": "lm", "mode": "fp16-pertensor", "metric": "top1",
                                           "at_least": -0.01}}]})
    md = tmp_path / "claims.md"
    args = ["claims", "--summary", str(tables / "summary.csv"), "--claims", str(claims), "--md", str(md)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(args) == 0
    assert out.getvalue().startswith("supported     flushes-less")
    assert "-0.05 pp" in md.read_text() and "paired by seed" in md.read_text()  # the census share shown in pp
    (tables / "runs.csv").unlink()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(args) == 2
    assert "claim flushes-less: reads the runs table, which was not given" in err.getvalue()


# --- the per-run kinds QLoRA's claims added (configs/claims_qlora.yaml): bound, and compare's growth horizon
def magnitudes(centre: float, n: int = 4) -> pd.DataFrame:
    """Per-run magnitudes spread by factors around ``centre`` (its geometric mean, exactly)."""
    factors = np.array([0.5, 2.0, 0.8, 1.25][:n])
    return pd.DataFrame({"mode": ["fp32"] * n, "seed": range(n), "g": centre * factors})


@pytest.mark.parametrize("centre, verdict", [(1e-4, C.CONTRADICTED), (1e-8, C.SUPPORTED), (1.2e-6, C.NOT_RESOLVED)])
def test_bound_on_the_runs_table_decides_on_log10_against_the_t_interval(tmp_path, centre, verdict):
    """bound {column, mode, at_most, log}: a one-sample t of log10(value) against log10(bound), n - 1 df: supported
    when shown below, contradicted when the one-sided bound at the level lies wholly above; its p is the t test's."""
    path = write(tmp_path, {"reads": "runs", "claims": [
        {"id": "small", **CLAIM, "bound": {"column": "g", "mode": "fp32", "at_most": 1e-6, "log": True}}]})
    table = magnitudes(centre)
    r = C.evaluate(C.load_file(path), {"runs": table})[0]
    assert r["verdict"] == verdict
    d = np.log10(table["g"].to_numpy()) - math.log10(1e-6)
    assert r["tests"][0]["p"] == pytest.approx(st.ttest_1samp(d, 0.0, alternative="less").pvalue, rel=1e-9)
    assert f"geometric mean {centre:.3g}" in r["evidence"]


def test_bound_needs_one_limit_and_a_spread(tmp_path):
    both = write(tmp_path, {"reads": "runs", "claims": [
        {"id": "b", **CLAIM, "bound": {"column": "g", "mode": "fp32", "at_most": 1.0, "at_least": 0.1}}]})
    with pytest.raises(C.ClaimsError, match="claim b: bound needs exactly one of at_least, at_most"):
        C.load_file(both)
    flat = pd.DataFrame({"mode": ["fp32"] * 3, "seed": range(3), "g": [2.0] * 3})
    path = write(tmp_path, {"reads": "runs", "claims": [
        {"id": "b", **CLAIM, "bound": {"column": "g", "mode": "fp32", "at_least": 1.0}}]})
    r = C.evaluate(C.load_file(path), {"runs": flat})[0]
    assert r["verdict"] == C.NOT_RESOLVED and "a spread of zero decides nothing" in r["tests"][0]["needs"]


def test_compare_with_a_horizon_is_out_of_reach_before_three_growth_intervals(tmp_path):
    """compare {..., horizon: true}: two scale rules that differ only in when they grow cannot differ before the
    first growth, so runs shorter than 3 growth intervals of either rule decide nothing (out of reach, with the
    length that would); at that length the paired t decides as without it."""
    rng = np.random.default_rng(1)
    def table(steps):
        return pd.DataFrame({"mode": ["gi1000"] * 4 + ["gi2000"] * 4, "seed": list(range(4)) * 2,
                             "steps": [steps] * 8, "growth_interval": [1000] * 4 + [2000] * 4,
                             "val_loss": np.r_[rng.normal(3.0, 0.01, 4), rng.normal(3.5, 0.01, 4)]})
    path = write(tmp_path, {"reads": "runs", "claims": [
        {"id": "faster", **CLAIM, "compare": {"column": "val_loss", "left": "gi1000", "is": "smaller",
                                              "right": "gi2000", "effect": 0.01, "horizon": True}}]})
    short = C.evaluate(C.load_file(path), {"runs": table(150)})[0]
    assert short["verdict"] == C.OUT_OF_REACH
    assert "runs of at least 6000 steps" in short["tests"][0]["needs"]
    assert "gi2000's runs are 150 steps and its scale grows every 2000" in short["tests"][0]["needs"]
    assert short["needs"] == short["tests"][0]["needs"]  # the claims table's `needs` says why, not only the test's
    assert "runs of at least 6000 steps" in C.to_markdown([short])
    assert C.evaluate(C.load_file(path), {"runs": table(6000)})[0]["verdict"] == C.SUPPORTED

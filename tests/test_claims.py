"""Claims as predicates over summary.csv (lab/claims.py): verdicts of every predicate kind on a crafted
summary where each is known, the claims file's validation, the README section, the CLI and the rule."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lab import claims as C
from lab.aggregate import aggregate
from lab.cli import main
from test_aggregate import crafted
from test_workflow import snakemake

REPO = Path(__file__).resolve().parent.parent

S, X, N = C.SUPPORTED, C.CONTRADICTED, C.NOT_RESOLVED


def srow(mode, top1=(0.0, 0.0), val_loss=(0.0, 0.0), eq=(False, False), overflow=0.0, skipped=0.0, n_pairs=4,
         model="a"):
    """One summary row: (delta, ci) per metric as aggregate writes them (top-1 as a fraction)."""
    row = {"model": model, "mode": mode, "n_seeds": n_pairs, "n_pairs": n_pairs,
           "overflow_steps": overflow, "skipped_pct": skipped}
    for name, (d, ci), e in (("top1", top1, eq[0]), ("val_loss", val_loss, eq[1])):
        row.update({f"{name}_delta": d, f"{name}_delta_ci": ci, f"{name}_equivalent": e, f"{name}_n_pairs": n_pairs})
    return row


SUMMARY = pd.DataFrame([
    srow("fp32", eq=(True, True)),
    srow("cost", top1=(-0.05, 0.01), val_loss=(0.2, 0.02), overflow=10.0, skipped=8.0),   # resolved costs
    srow("small", top1=(-0.001, 0.001), val_loss=(0.001, 0.002), eq=(True, True), overflow=0.5, skipped=0.4),
    srow("noisy", top1=(0.0, 0.05), val_loss=(0.0, 0.3), overflow=1.0, skipped=0.9),       # nothing resolved
    srow("gain", top1=(0.02, 0.005), val_loss=(-0.1, 0.01)),                                # resolved gains
    srow("tiny_cost", top1=(-0.004, 0.002), eq=(True, False)),     # a resolved cost inside the margin
    srow("one_seed", top1=(-0.05, math.nan), n_pairs=1),           # no interval
])


def side(mode, model="a"):
    return {"model": model, "mode": mode}


def one(kind, body, summary=SUMMARY):
    return C.check(kind, body, summary)


def bound(mode, **limit):
    return {"model": "a", "mode": mode, "metric": limit.pop("metric", "top1"), **limit}


def tm(mode, metric="top1", model="a"):
    return {"model": model, "mode": mode, "metric": metric}


# --- verdicts of each kind --------------------------------------------------------------------------------
@pytest.mark.parametrize("body, verdict", [
    (bound("small", at_least=-0.003), S),       # [-0.2, 0.0] pp >= -0.3
    (bound("cost", at_least=-0.003), X),        # [-6, -4] pp entirely below
    (bound("noisy", at_least=-0.003), N),       # straddles
    (bound("cost", at_most=-0.01), S),
    (bound("gain", at_most=-0.01), X),
    (bound("noisy", at_most=-0.01), N),
    (bound("cost", at_most=0.1, metric="val_loss"), X),   # [0.18, 0.22] nats > 0.1
    (bound("one_seed", at_least=-0.003), N),    # a mean alone decides nothing
])
def test_bound(body, verdict):
    assert one("bound", body).verdict == verdict


def test_bound_evidence_has_the_interval_and_the_bound():
    out = one("bound", bound("cost", at_least=-0.003))
    assert out.evidence == "a cost top1 Δ -5.00 ± 1.00 pp = [-6.00, -4.00], claim Δ ≥ -0.30 pp"
    assert "no interval: 1 pair(s)" in one("bound", bound("one_seed", at_least=-0.003)).evidence


@pytest.mark.parametrize("left, is_, right, verdict", [
    ("cost", "smaller", "small", S),
    ("gain", "smaller", "small", X),
    ("noisy", "smaller", "small", N),
    ("gain", "larger", "cost", S),
    ("cost", "larger", "gain", X),
    ("one_seed", "smaller", "small", N),
])
def test_compare(left, is_, right, verdict):
    out = one("compare", {"metric": "top1", "left": side(left), "is": is_, "right": side(right)})
    assert out.verdict == verdict


def test_compare_evidence_names_both_rows():
    out = one("compare", {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("small")})
    assert out.evidence == "a cost top1 Δ -5.00 ± 1.00 pp vs a small -0.10 ± 0.10 pp, claim: smaller"


@pytest.mark.parametrize("body, verdict", [
    (tm("small"), S), (tm("small", "val_loss"), S),
    (tm("cost"), X), (tm("cost", "val_loss"), X),
    (tm("noisy"), N),
    (tm("gain"), N),          # a gain beyond the margin is not equivalent, but no cost either
    (tm("tiny_cost"), S),     # cost resolved, but inside the margin fixed in advance
    (tm("one_seed"), N),
])
def test_equivalent(body, verdict):
    assert one("equivalent", body).verdict == verdict


@pytest.mark.parametrize("body, verdict", [
    (tm("cost"), S), (tm("cost", "val_loss"), S),   # top-1 down; validation loss up
    (tm("gain"), X), (tm("gain", "val_loss"), X),   # top-1 up; validation loss down
    (tm("small"), X),                                # equivalent
    (tm("noisy"), N),
    (tm("tiny_cost"), S),
    (tm("one_seed"), N),
])
def test_cost(body, verdict):
    assert one("cost", body).verdict == verdict


def test_tost_evidence_says_what_was_resolved():
    assert one("equivalent", tm("tiny_cost")).evidence == (
        "a tiny_cost top1 Δ -0.40 ± 0.20 pp, cost resolved, TOST equivalent")
    assert one("cost", tm("noisy", "val_loss")).evidence.endswith("no resolved difference, TOST not equivalent")


@pytest.mark.parametrize("left, right, column, verdict", [
    ("cost", "small", None, S),            # 10 vs 0.5
    ("small", "cost", None, X),
    ("noisy", "small", None, N),           # 1.0 vs 0.5: under one step apart
    ("cost", "noisy", "skipped_pct", S),   # 8 vs 0.9
    ("noisy", "small", "skipped_pct", N),
])
def test_more_overflow(left, right, column, verdict):
    body = {"left": side(left), "right": side(right), **({"column": column} if column else {})}
    out = one("more_overflow", body)
    assert out.verdict == verdict
    assert out.evidence.startswith(f"a {left} {column or 'overflow_steps'} ")


@pytest.mark.parametrize("parts, verdict", [
    ([S, S], S), ([S, X], X), ([S, N], N), ([N, X], X), (["missing", S], N), (["missing", X], X),
])
def test_all(parts, verdict):
    pick = {S: {"cost": tm("cost")}, X: {"cost": tm("gain")}, N: {"cost": tm("noisy")},
            "missing": {"cost": tm("cost", model="zz")}}
    out = one("all", [pick[p] for p in parts])
    assert out.verdict == verdict
    assert out.evidence.count("; ") == len(parts) - 1


@pytest.mark.parametrize("kind, body", [
    ("bound", bound("cost", at_least=0.0) | {"model": "zz"}),
    ("compare", {"metric": "top1", "left": side("cost"), "is": "smaller", "right": side("cost", "zz")}),
    ("equivalent", tm("cost", model="zz")),
    ("cost", tm("absent-mode")),
    ("more_overflow", {"left": side("cost", "zz"), "right": side("small")}),
    ("all", [{"cost": tm("cost", model="zz")}]),
])
def test_missing_model_or_mode_is_not_resolved(kind, body):
    out = one(kind, body)
    assert out.verdict == N
    assert "no rows for " in out.evidence


def test_summary_without_a_column_is_not_resolved():
    out = one("cost", tm("cost", "val_loss"), SUMMARY.drop(columns=["val_loss_delta"]))
    assert out == C.Outcome(N, "a cost: summary.csv has no val_loss_delta column (re-run aggregate)")


def test_verdicts_on_a_summary_written_by_aggregate(tmp_path):
    """The column names claims.py reads are the ones aggregate writes (test_aggregate's crafted runs)."""
    aggregate(crafted(tmp_path), tmp_path / "s.csv", tmp_path / "s.md")
    summary = C.load_summary(tmp_path / "s.csv")
    m = {"model": "m"}
    assert one("cost", {**m, "mode": "cost", "metric": "top1"}, summary).verdict == S
    assert one("cost", {**m, "mode": "cost", "metric": "val_loss"}, summary).verdict == S
    assert one("equivalent", {**m, "mode": "same", "metric": "val_loss"}, summary).verdict == S
    assert one("equivalent", {**m, "mode": "noisy", "metric": "top1"}, summary).verdict == N
    assert one("cost", {**m, "mode": "better", "metric": "top1"}, summary).verdict == X
    assert one("bound", {**m, "mode": "cost", "metric": "top1", "at_least": -0.003}, summary).verdict == X


# --- the claims file --------------------------------------------------------------------------------------
def test_the_study_claims_file_is_valid_and_evaluates():
    claims = C.load_claims(REPO / "configs" / "claims.yaml")
    assert len(claims) >= 6
    def kinds(pred: dict) -> set:
        kind, body = next(iter(pred.items()))
        return {kind}.union(*(kinds(p) for p in body)) if kind == "all" else {kind}
    assert set().union(*(kinds({k: v for k, v in c.items() if k not in C.CLAIM_KEYS}) for c in claims)) == set(C.KINDS)
    records = C.evaluate(claims, SUMMARY)  # none of its models is in this table
    assert {r["verdict"] for r in records} == {N}
    assert all("no rows for " in r["evidence"] for r in records)


GOOD = {"id": "c1", "text": "t", "source": "s"}


@pytest.mark.parametrize("claim, message", [
    ({**GOOD, "bond": tm("x")}, "claim c1: unknown predicate kind 'bond'; allowed: bound, compare, equivalent, "
                                "cost, more_overflow, all"),
    ({**GOOD, "cost": {**tm("x"), "metrc": "top1"}}, "claim c1: cost: unknown key(s) metrc; allowed: metric, mode, "
                                                      "model"),
    ({**GOOD, "cost": {"model": "a", "mode": "b"}}, "claim c1: cost: missing key(s) metric"),
    ({**GOOD, "cost": tm("x", "top5")}, "claim c1: cost.metric: 'top5' is not allowed; allowed: top1, val_loss"),
    ({**GOOD, "bound": bound("x")}, "claim c1: bound needs exactly one of at_least, at_most"),
    ({**GOOD, "bound": bound("x", at_least=-1, at_most=1)}, "exactly one of at_least, at_most"),
    ({**GOOD, "bound": bound("x", at_least="0.3pp")}, "bound.at_least must be a number"),
    ({**GOOD, "compare": {"metric": "top1", "left": side("x"), "is": "bigger", "right": side("y")}},
     "claim c1: compare.is: 'bigger' is not allowed; allowed: larger, smaller"),
    ({**GOOD, "compare": {"metric": "top1", "left": {"model": "x"}, "is": "larger", "right": side("y")}},
     "claim c1: compare.left: missing key(s) mode"),
    ({**GOOD, "more_overflow": {"left": side("x"), "right": side("y"), "column": "loss"}},
     "allowed: overflow_steps, skipped_pct"),
    ({**GOOD, "all": [{"cost": tm("x")}, {"nope": {}}]}, "claim c1: unknown predicate kind 'nope'"),
    ({**GOOD, "all": []}, "claim c1: `all` needs a non-empty list of predicates"),
    ({**GOOD, "cost": tm("x"), "equivalent": tm("x")}, "claim c1: needs exactly one predicate, got cost, equivalent"),
    ({**GOOD}, "claim c1: needs exactly one predicate, got none; allowed: bound"),
    ({"id": "c1", "text": "t", "cost": tm("x")}, "claim c1: needs `source`"),
    ({"text": "t", "source": "s", "cost": tm("x")}, "claim #1 needs an `id`"),
    ({**GOOD, "cost": {**tm("x"), "model": 50}}, "claim c1: cost.model: expected a name"),
])
def test_validation_errors_name_the_claim_and_the_allowed_values(claim, message):
    with pytest.raises(C.ClaimsError) as e:
        C.validate_claims([claim])
    assert message in str(e.value)


def test_validation_of_the_file_as_a_whole(tmp_path):
    with pytest.raises(C.ClaimsError, match="appears twice"):
        C.validate_claims([{**GOOD, "cost": tm("x")}, {**GOOD, "cost": tm("y")}])
    with pytest.raises(C.ClaimsError, match="expected a non-empty list of claims"):
        C.validate_claims({"claims": []})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- id: c1\n  text: [unclosed\n")
    with pytest.raises(C.ClaimsError, match="not valid YAML"):
        C.load_claims(bad)
    with pytest.raises(C.ClaimsError, match="not found"):
        C.load_claims(tmp_path / "none.yaml")


# --- markdown and the README section ----------------------------------------------------------------------
RECORDS = [{"id": "c1", "text": "a | b", "source": "s", "verdict": S, "evidence": "x ± y"}]


def test_markdown_table_and_legend():
    lines = C.to_markdown(RECORDS).splitlines()
    assert lines[:3] == ["| claim | verdict | evidence |", "|---|---|---|",
                         "| a \\| b (`c1`) | **supported** | x ± y |"]
    assert lines[3] == "" and lines[4] == C.LEGEND and len(lines) == 5


def test_readme_section_is_replaced_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    start, end = C.MARKERS
    readme.write_text(f"# T\n\nbefore\n{start}\nstale findings\n{end}\nafter\n")
    assert C.write_readme_section(readme, "| new |\n")
    assert readme.read_text() == f"# T\n\nbefore\n{start}\n| new |\n{end}\nafter\n"
    assert not C.write_readme_section(readme, "| new |\n")  # unchanged: not rewritten
    for text in ("# no markers\n", f"{end}\n{start}\n", f"{start} only\n"):
        readme.write_text(text)
        with pytest.raises(C.ClaimsError, match="needs the markers"):
            C.write_readme_section(readme, "x")
        assert readme.read_text() == text


# --- CLI and rule -----------------------------------------------------------------------------------------
CLAIMS = [
    {"id": "holds", "text": "costs", "source": "s", "cost": tm("cost")},
    {"id": "fails", "text": "no cost", "source": "s", "equivalent": tm("cost")},
    {"id": "open", "text": "small", "source": "s", "bound": bound("noisy", at_least=-0.003)},
    {"id": "gone", "text": "lm", "source": "s", "cost": tm("fp16-noscale", "val_loss", model="lm")},
]


@pytest.fixture
def inputs(tmp_path):
    SUMMARY.to_csv(tmp_path / "summary.csv", index=False)
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(CLAIMS, sort_keys=False))
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n{C.MARKERS[0]}\nold\n{C.MARKERS[1]}\n")
    return tmp_path


def args(d, *extra):
    return ["claims", "--summary", str(d / "summary.csv"), "--claims", str(d / "claims.yaml"),
            "--md", str(d / "out" / "claims.md"), *extra]


def test_cli_prints_writes_and_updates_the_readme(inputs, capsys):
    assert main(args(inputs, "--readme", str(inputs / "README.md"))) == 0
    out = capsys.readouterr().out
    for verdict, cid in ((S, "holds"), (X, "fails"), (N, "open"), (N, "gone")):
        assert f"{verdict:<13} {cid}: " in out
    assert "no rows for lm fp16-noscale" in out
    md = (inputs / "out" / "claims.md").read_text()
    assert md.startswith("| claim | verdict | evidence |") and md.count("\n| ") == len(CLAIMS)
    assert md.strip() in (inputs / "README.md").read_text()


def test_cli_json(inputs, capsys):
    assert main(args(inputs, "--json")) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["verdict"]) for r in records] == [("holds", S), ("fails", X), ("open", N), ("gone", N)]
    assert records[0]["evidence"].startswith("a cost top1 Δ -5.00 ± 1.00 pp")


@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "summary.csv").unlink(), "summary.csv not found"),
    (lambda d: (d / "claims.yaml").write_text("- id: x\n  text: t\n  source: s\n  cosst: {}\n"),
     "claim x: unknown predicate kind 'cosst'; allowed: bound,"),
    (lambda d: (d / "README.md").write_text("# no markers\n"), "needs the markers"),
])
def test_cli_bad_input_exits_2_with_one_line(inputs, capsys, break_it, message):
    break_it(inputs)
    assert main(args(inputs, "--readme", str(inputs / "README.md"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (inputs / "out" / "claims.md").exists()


def test_python_m_lab_claims(inputs):
    res = subprocess.run([sys.executable, "-m", "lab", *args(inputs)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "contradicted  fails: no cost" in res.stdout


def test_rule_writes_the_table_and_reruns_on_a_claim_edit(repo_copy):
    tables = repo_copy / "results" / "tables"
    tables.mkdir(parents=True)
    SUMMARY.to_csv(tables / "summary.csv", index=False)
    res = snakemake(repo_copy, "--cores", "1", "results/tables/claims.md", "--allowed-rules", "claims")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tables / "claims.md").read_text().startswith("| claim | verdict | evidence |")
    assert "not resolved" in (repo_copy / "results" / "logs" / "claims.log").read_text()
    with open(repo_copy / "configs" / "claims.yaml", "a") as f:
        f.write(yaml.safe_dump([CLAIMS[0]]))
    dry = snakemake(repo_copy, "-n", "results/tables/claims.md")
    assert dry.returncode == 0, dry.stderr[-2000:]
    stats = dry.stdout.split("Job stats:")[1].split("\n\n")[0]
    counts = {line.split()[0]: line.split()[1] for line in stats.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts == {"claims": "1", "total": "1"}, dry.stdout

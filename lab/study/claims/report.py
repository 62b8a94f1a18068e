"""The claims' reports, from the records lab/study/claims/ decides: the claims table (a row per claim:
results/*/tables/claims.md from `lab claims`), the README's compact section, the CLI's text, where the claims and the
findings table read one cell differently, and the table with a row per test (`markdown_by_test`: results/rl/tables/
claims.md from `lab rl-claims`)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lab.core import files
from lab.study.claims.base import (CLAIM_KEYS, CONTRADICTED, NOT_RESOLVED, OUT_OF_REACH, REACH, REGISTRY, SUPPORTED,
                                   ClaimsError)
from lab.study.claims.summary import METRICS
MARKERS = ("<!-- claims:start -->", "<!-- claims:end -->")


def legend(reach: dict | None = None, runs: bool = False) -> str:
    """The note under the claims table: how each verdict is reached, with the reach settings in force (``runs``:
    some claims read the per-run table)."""
    r = {**REACH, **(reach or {})}
    return ("Each claim is two one-sided tests on the summary's cells (Δ = mode − FP32 on the same seeds and "
            "examples, its standard error from the family's pooled seed spread and the examples; overflow: an exact "
            "Poisson test of the in-training overflow counts with the steps as exposure); supported / "
            "contradicted: that test, Holm-adjusted over every test of every claim (family-wise error 5%), rejects; "
            "p_adj is the adjusted p-value. not resolved: neither does, with the paired seeds a declared effect "
            f"would need ({r['power']:.0%} power; at the pooled spread – its upper 90% bound); out of reach: that is "
            f"more than {r['max_seeds']} seeds, the seeds cannot decide it (a spread of zero, the test set's own "
            f"noise), the runs are shorter than {r['horizon_intervals']:g} growth intervals of the policy, or the "
            "policy has no growth interval." + (
                " A claim that reads the per-run table (results/tables/runs.csv, `reads: runs`) is a one-sided test "
                "on the runs paired by seed (lab/study/claims/runs.py): its p-value joins the same Holm family, and it "
                "is contradicted when its bound at Holm's first level rules out the declared effect (equivalent: lies "
                "beyond the margin)." if runs else "") + " Claims, margins and predicates: configs/claims.yaml.")


# --- output -----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _plan_line(records: list[dict], plan: str) -> list[str]:
    if not plan or not records:
        return []
    return ["", _plan_text(records, plan)]


def _plan_text(records: list[dict], plan: str) -> str:
    return (f"Group-sequential plan (declared in the claims file): Holm decides at {records[0]['alpha']:.3g}, not 5%: "
            f"{plan}; the error rate spent over every look stays 5% (lab/study/sequential.py).")


def to_markdown(records: list[dict], reach: dict | None = None, plan: str = "", runs: bool = False) -> str:
    """claim | verdict | needs | evidence, one row per claim, and the legend (for the reach settings used; ``runs``:
    some claims read the per-run table)."""
    lines = ["| claim | verdict | p_adj | needs | evidence |", "|---|---|---|---|---|"]
    for r in records:
        p = r.get("p_adj", math.nan)
        p = f"{p:.2g}" if isinstance(p, float) and math.isfinite(p) else "—"
        lines.append(f"| {_cell(r['text'])} (`{r['id']}`) | **{r['verdict']}** | {p} | {_cell(r.get('needs', ''))} | "
                     f"{_cell(r['evidence'])} |")
    return "\n".join(lines + ["", legend(reach, runs)] + _plan_line(records, plan)) + "\n"


def _short(evidence: str) -> str:
    """The first clause of a claim's evidence (the numbers that decide it), cut to one short line."""
    head = str(evidence).split("; ")[0]
    return head if len(head) <= 110 else head[:107].rstrip() + "..."


def table_disagreements(claims: list[dict], records: list[dict], summary: pd.DataFrame) -> list[str]:
    """Where a claim about one cell is decided while the summary table leaves that cell unresolved (or the other
    way), one sentence saying why both stand: the claim tests one direction of one cell under Holm over the claims'
    tests; the table tests both directions of every cell under Benjamini–Hochberg."""
    out = []
    n_tests = _members(claims)
    for claim, rec in zip(claims, records):
        kind = next(k for k in claim if k not in CLAIM_KEYS)
        body = claim[kind]
        if not (isinstance(body, dict) and {"model", "mode", "metric"} <= set(body)):
            continue
        row = summary[(summary["model"] == body["model"]) & (summary["mode"] == body["mode"])]
        cell = str(row.iloc[0].get(f"{body['metric']}_verdict", "")) if len(row) else ""
        decided = rec["verdict"] in (SUPPORTED, CONTRADICTED)
        if not cell or decided == (cell not in ("not resolved", "nan", "")):
            continue
        tests = int(sum(summary[f"{m}_p"].notna().sum() for m in METRICS if f"{m}_p" in summary))
        out.append(f"{body['model']} {body['mode']} {body['metric']}: {rec['verdict']} as `{rec['id']}` (one-sided, "
                   f"Holm over the claims' {n_tests} tests), {cell} in the findings table (two-sided, "
                   f"Benjamini–Hochberg over its {tests} tests): the claim asks one direction of one cell, the "
                   "table both directions of every cell, so each is right at its own error rate.")
    return out


def _members(claims: list[dict]) -> int:
    """How many p-values the claims put in the Holm family: two for a two-sided test, one for a one-sided one (a
    per-run kind; `all` on the runs table: each part)."""
    n = 0
    for claim in claims:
        reads = claim.get("reads", "summary")
        kind = next(k for k in claim if k not in CLAIM_KEYS)
        parts = ([next(iter(item)) for item in claim["all"]] if kind == "all" and (reads, "all") not in REGISTRY
                 else [kind])
        n += sum(1 if REGISTRY[(reads, k)].family == "one-sided" else 2 for k in parts)
    return n


def readme_markdown(records: list[dict], full_table: str = "results/tables/claims.md",
                    disagreements: list[str] | None = None, plan: str = "") -> str:
    """The README's compact claims table: claim, verdict, Holm-adjusted p and one short evidence line; the full
    evidence is in `full_table`; ``disagreements`` (table_disagreements) under it."""
    lines = ["| claim | verdict | p_adj | evidence |", "|---|---|---|---|"]
    for r in records:
        p = r.get("p_adj", math.nan)
        p = f"{p:.2g}" if isinstance(p, float) and math.isfinite(p) else "—"
        evidence = _cell(_short(r["evidence"]))
        lines.append(f"| {_cell(r['text'])} (`{r['id']}`) | **{r['verdict']}** | {p} | {evidence} |")
    extra = (" Table and claims: " + " ".join(disagreements) if disagreements else "") + (
        " " + _plan_text(records, plan) if plan and records else "")
    return "\n".join(lines + ["", f"Holm over every test of every claim (family-wise error 5%); p_adj: the adjusted "
                               f"p-value of the verdict's test; seeds sized at Holm's first step. Full evidence, "
                               f"seeds needed and reasons: [{full_table}]({full_table}); method: "
                               "[docs/statistics.md](docs/statistics.md)." + extra]) + "\n"


def markdown_by_test(records: list[dict], title: str, intro: str) -> str:
    """A row per test: claim | verdict (and why) | test (its state) | estimate | p (Holm) | what would decide it,
    under ``title`` and ``intro``, the claims' sources below."""
    lines = [f"# {title}", "", intro, "",
             "| claim | verdict | test | estimate | p (Holm) | what would decide it |", "|---|---|---|---|---|---|"]
    for c in records:
        for i, t in enumerate(c["tests"]):
            head = (f"**{c['id']}**: {c['text']}", f"**{c['verdict']}**" + (f" ({c['why']})" if c["why"] else "")) \
                if i == 0 else ("", "")
            q = "—" if not math.isfinite(t["p_holm"]) else f"{t['p_holm']:.2g}"
            needs = t["needs"] if t["state"] in (NOT_RESOLVED, OUT_OF_REACH) else ""
            cells = (head[0], head[1], f"{t['what']} ({t['state']})", t["estimate"], q, needs)
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # a claim may say |d|
    lines += ["", "Sources:", ""] + [f"- {c['id']}: {c['source']}" for c in records]
    return "\n".join(lines) + "\n"


def to_text(records: list[dict]) -> str:
    """What the CLI prints: the verdict, the claim, what it needs and its evidence indented below."""
    return "".join(f"{r['verdict']:<13} {r['id']}: {r['text']}\n{'':14}needs: {r.get('needs', '')}\n"
                   f"{'':14}{r['evidence']}\n" for r in records)


def write_readme_section(readme_path, markdown: str, markers: tuple[str, str] = MARKERS) -> bool:
    """Replace the text between the markers (kept; the claims section's by default) with `markdown`; True when
    the file changed.

    Markers missing, or out of order, are an error rather than a silent append: the section's place in the
    README is an editorial choice.
    """
    path = Path(readme_path)
    if not path.is_file():
        raise ClaimsError(f"{path} not found")
    text = path.read_text()
    start, end = markers
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise ClaimsError(f"{path}: needs the markers {start} and {end} (in that order) around the claims section")
    new = f"{text[:i + len(start)]}\n{markdown.strip()}\n{text[j:]}"
    if new == text:
        return False
    files.atomic_write_text(path, new)
    return True

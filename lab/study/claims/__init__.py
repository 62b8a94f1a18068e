"""The claims engine: every study's claims, stated in a claims file (configs/claims*.yaml) as predicates over its
tables and decided as one family.

A claim is one predicate, or `all` of several, of a kind registered in base.py's registry (this package's modules:
lab/study/claims/): on the aggregated summary's cells (`summary`: the default study's kinds, summary.py and
trajectory.py) or on a per-run table paired by seed (`runs`: the RL study's kinds, runs.py). file.py reads and
checks the file; this module decides. Every test of every claim is one Holm family (the family-wise
error at alpha: the file's `alpha`, else 1 − the summary's confidence; a group-sequential plan lowers it): a
two-sided kind's support and contradiction p-values both join it; a one-sided kind's support p-value joins it (a test
that cannot be computed counts as p = 1) and its bound at Holm's first level contradicts. `all` over summary kinds is
one test (intersection–union); on the runs table its parts are tests of their own and the claim is contradicted when
one is, supported when all are. A claim that `requires` another is out of reach until that one is supported.

One verdict vocabulary: supported, contradicted, not resolved (with the paired seeds a declared effect would need: a
range, at the pooled spread and at its upper 90% bound; or what would decide it), out of reach (more than
REACH["max_seeds"] seeds, runs shorter than REACH["horizon_intervals"] growth intervals of the policy, a policy with
no growth interval, a spread of zero). lab/study/claims/report.py writes the reports (`lab claims`: the claims table
and the README's section; `lab rl-claims`: a row per test).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.study import inference
from lab.study.claims.base import (CONTRADICTED, NOT_RESOLVED, OUT_OF_REACH, REGISTRY, SUPPORTED,  # noqa: F401
                                   VERDICTS, Outcome, Test, kinds, register, run_test)
from lab.study.claims.file import (CLAIM_KEYS, COUNT_COLUMNS, DIRECTIONS, METRICS, REACH,  # noqa: F401
                                   ROW_KEYS, ClaimsError, load_claims, load_file, load_sequential, load_summary,
                                   validate_claims)
# the reports (lab/study/claims/report.py), re-exported for callers
from lab.study.claims.report import (MARKERS, _cell, legend, readme_markdown, table_disagreements,  # noqa: F401
                                     markdown_by_test, to_markdown, to_text, write_readme_section)
from lab.study.claims.summary import DEFAULT_CONFIDENCE, DEFAULT_MARGINS, NAMES, _confidence  # noqa: F401

LEGEND = legend()
test = run_test  # one predicate's test: (kind, body, tables, reach, reads="summary") -> Test


# --- evaluation -------------------------------------------------------------------------------------------
def evaluate(claims, tables, reach: dict | None = None, plans: dict | None = None) -> list[dict]:
    """One record per claim: id, text, source, verdict, why (a requirement not met), needs, evidence, p_support /
    p_contradict (raw), p_adj (Holm over the file's tests), alpha, and its tests (what, estimate, p, p_holm, state,
    needs). ``claims``: the list of claims, or load_file's {claims, reads, alpha, power, max_seeds} (and `sizing`:
    False words no seeds needed); ``tables``: {summary | runs | shape: DataFrame}, or the summary alone. `reach`
    overrides REACH (power, max_seeds, horizon_intervals). `plans`: the group-sequential plans; Holm then decides at
    the smallest nominal level of the planned families at their looks (lab/study/sequential.py)."""
    cfg = claims if isinstance(claims, dict) else {"claims": claims}
    tables = {"summary": tables} if isinstance(tables, pd.DataFrame) else dict(tables)
    summary = tables.get("summary")
    reach = _reach({**{k: cfg[k] for k in ("power", "max_seeds") if k in cfg}, **(reach or {})})
    alpha = cfg.get("alpha") or 1 - _confidence(summary)
    if summary is not None:
        alpha = sequential_alpha(plans, summary, alpha)[0]
    flat = [(c, reads, kind, body) for c in cfg["claims"] for reads, kind, body in _parts(c, cfg.get("reads"))]
    members = sum(1 if _one_sided(reads, kind) else 2 for _, reads, kind, _ in flat)
    # sized at the level the verdict needs: Holm's first step over every test of the file (one-sided: `level`;
    # the summary's kinds size two-sided tests at twice that)
    reach = {**reach, "level": alpha / members, "size_alpha": 2 * alpha / members, "sizing": cfg.get("sizing", True)}
    tests = [_run(c, reads, kind, body, tables, reach) for c, reads, kind, body in flat]
    adjusted = holm_family(tests)
    records, verdicts = [], {}
    for c in cfg["claims"]:
        mine = [(t, q, reads, kind, body) for (cc, reads, kind, body), t, q in zip(flat, tests, adjusted) if cc is c]
        records.append(_record(c, mine, summary, alpha, reach, verdicts))
        verdicts[c["id"]] = records[-1]["verdict"]
    return records


def _parts(claim: dict, reads: str | None) -> list[tuple[str, str, object]]:
    """(table, kind, body) of each test of a claim: one, or `all`'s parts where the table has no `all` kind."""
    reads = claim.get("reads", reads or "summary")
    kind = next(k for k in claim if k not in CLAIM_KEYS)
    if kind == "all" and (reads, "all") not in REGISTRY:
        return [(reads, *next(iter(item.items()))) for item in claim["all"]]
    return [(reads, kind, claim[kind])]


def _one_sided(reads: str, kind: str) -> bool:
    return REGISTRY[(reads, kind)].family == "one-sided"


def _run(claim: dict, reads: str, kind: str, body, tables: dict, reach: dict) -> Test:
    try:
        return run_test(kind, body, tables, reach, reads)
    except KeyError as e:
        if e.args and e.args[0] == reads:
            raise ClaimsError(f"claim {claim['id']}: reads the {reads} table, which was not given") from None
        raise
    except ClaimsError as e:
        raise ClaimsError(f"claim {claim['id']}: {e}") from None


def holm_family(tests: list[Test]) -> list[tuple[float, float]]:
    """Each test's Holm-adjusted (support, contradiction) p-values over the family of every test's members: a
    two-sided test's two p-values (NaN: not a member), a one-sided test's support p-value (its contradiction is a
    bound: NaN here; a test that cannot be computed counts as p = 1 while any one-sided test can be)."""
    any_one = any(t.one_sided and math.isfinite(t.p_support) and not t.blocked for t in tests)
    raw = []
    for t in tests:
        if t.one_sided:
            raw.append(t.p_support if math.isfinite(t.p_support) and not t.blocked else 1.0 if any_one else math.nan)
        else:
            raw += [t.p_support, t.p_contradict]
    adj, out, i = inference.holm_adjust(np.array(raw, float)), [], 0
    for t in tests:
        out.append((float(adj[i]), math.nan) if t.one_sided else (float(adj[i]), float(adj[i + 1])))
        i += 1 if t.one_sided else 2
    return out


def _record(claim: dict, mine: list, summary, alpha: float, reach: dict, verdicts: dict) -> dict:
    """A claim's record from its tests and their adjusted p-values."""
    rows, outcomes = [], []
    for t, (a_s, a_c), reads, kind, body in mine:
        if t.one_sided:
            state = state_one_sided(t, a_s, alpha)
            evidence = f"{t.what}: {t.evidence}" if t.what else t.evidence
            rows.append({"what": t.what, "estimate": t.evidence, "p": t.p_support, "p_holm": a_s, "state": state,
                         "needs": "; ".join(x for x in (t.blocked, t.needs) if x)})
            # an undecided test says why and what would decide it (a claims table shows it; decided: nothing)
            what = rows[-1]["needs"] if state not in (SUPPORTED, CONTRADICTED) else ""
            outcomes.append((Outcome(state, evidence), t.p_support, math.nan, a_s if math.isfinite(a_s) else math.nan,
                             what))
            continue
        out = decide(t, a_s, a_c, alpha, reach)
        what = needs(kind, body, summary, reach, reads)
        rows.append({"what": kind, "estimate": out.evidence, "p": t.p_support, "p_holm": _adj_shown(out.verdict,
                     a_s, a_c), "state": out.verdict, "needs": what})
        outcomes.append((out, t.p_support, t.p_contradict, rows[-1]["p_holm"], what))
    verdict, why = combine([r["state"] for r in rows]), ""
    if claim.get("requires") and verdicts.get(claim["requires"]) != SUPPORTED:
        # a claim about a gap (closing it) says nothing where the gap itself is not shown, whatever its own test
        verdict, why = OUT_OF_REACH, f"needs {claim['requires']} supported, which is {verdicts.get(claim['requires'])}"
    if len(outcomes) == 1:
        (out, p_s, p_c, p_adj, what), = outcomes
    else:
        finite = [o[3] for o in outcomes if math.isfinite(o[3])]
        out = Outcome(verdict, "; ".join(o[0].evidence for o in outcomes))
        p_s, p_c, p_adj, what = math.nan, math.nan, max(finite) if finite else math.nan, ""
    return {"id": claim["id"], "text": claim["text"], "source": claim["source"], "verdict": verdict, "why": why,
            "needs": what, "evidence": out.evidence, "p_support": p_s, "p_contradict": p_c, "p_adj": p_adj,
            "alpha": alpha, "tests": rows}


def combine(states: list[str]) -> str:
    """A claim's verdict from its tests': contradicted when one is, supported when all are, out of reach when one
    is, else not resolved."""
    if CONTRADICTED in states:
        return CONTRADICTED
    if all(s == SUPPORTED for s in states):
        return SUPPORTED
    return OUT_OF_REACH if OUT_OF_REACH in states else NOT_RESOLVED


def state_one_sided(t: Test, q: float, alpha: float) -> str:
    """A one-sided test's verdict from its Holm-adjusted p-value and its bound."""
    shown = math.isfinite(q) and q <= alpha and not t.blocked
    if t.contradicted or (t.excludes_effect and not shown):
        return CONTRADICTED
    if t.blocked:
        return OUT_OF_REACH if t.needs else NOT_RESOLVED
    if shown:
        return SUPPORTED
    return OUT_OF_REACH if t.needs.startswith("more than") else NOT_RESOLVED


def sequential_alpha(plans: dict | None, summary: pd.DataFrame, alpha: float) -> tuple[float, str]:
    """(the level the claims are decided at, why): ``alpha``, or the smallest nominal level of a planned family at
    the look its seeds in hand reach (`n_pairs` in the summary)."""
    from lab.study import sequential
    best, why = alpha, ""
    for family, plan in (plans or {}).items():
        rows = summary[summary["model"] == family] if "model" in summary else summary.iloc[0:0]
        seeds = float(pd.to_numeric(rows.get("n_pairs", pd.Series(dtype=float)), errors="coerce").max())
        if not math.isfinite(seeds):
            continue
        try:
            level, look = sequential.look_level(plan, int(seeds), alpha)
        except sequential.SequentialError as e:
            raise ClaimsError(f"sequential.{family}: {e}") from None
        if level < best:
            best = level
            why = (f"{family}'s {plan.get('spending', 'obrien-fleming')} plan, look {look} of {len(plan['looks'])} "
                   f"({int(seeds)} seeds; looks at {', '.join(map(str, plan['looks']))})")
    return best, why


def _adj_shown(verdict: str, a_s: float, a_c: float) -> float:
    if verdict == SUPPORTED:
        return float(a_s)
    if verdict == CONTRADICTED:
        return float(a_c)
    finite = [p for p in (a_s, a_c) if math.isfinite(p)]
    return float(min(finite)) if finite else math.nan


def decide(t: Test, adj_support: float, adj_contradict: float, alpha: float, reach: dict) -> Outcome:
    """The verdict of one tested claim from its Holm-adjusted p-values, at ``alpha``."""
    at = "" if abs(alpha - (1 - DEFAULT_CONFIDENCE)) < 1e-12 else f" (at the sequential plan's {alpha:.3g})"
    if math.isfinite(adj_support) and adj_support <= alpha:
        return Outcome(SUPPORTED, f"{t.evidence}; supported, Holm-adjusted p = {adj_support:.2g}{at}")
    if math.isfinite(adj_contradict) and adj_contradict <= alpha:
        return Outcome(CONTRADICTED, f"{t.evidence}; contradicted, Holm-adjusted p = {adj_contradict:.2g}{at}")
    if t.blocked:
        return Outcome(t.blocked_kind, f"{t.evidence}; {t.blocked}" if t.evidence else t.blocked)
    adj = min([p for p in (adj_support, adj_contradict) if math.isfinite(p)], default=math.nan)
    ev = f"{t.evidence}; Holm-adjusted p = {adj:.2g}" if math.isfinite(adj) else t.evidence
    lo, hi = t.seeds
    if not t.seeds_what:
        return Outcome(NOT_RESOLVED, ev)
    if not math.isfinite(lo):
        return Outcome(OUT_OF_REACH, f"{ev}; for {t.seeds_what} no number of paired seeds suffices: the validation "
                                     "set's own noise is larger than the effect")
    if hi > reach["max_seeds"]:
        what = inference.fmt_seeds((lo, hi))
        return Outcome(OUT_OF_REACH, f"{ev}; {t.seeds_what} needs {what} paired seeds ({reach['power']:.0%} power); "
                                     f"at most {reach['max_seeds']} in reach")
    return Outcome(NOT_RESOLVED, f"{ev}; {t.seeds_what} needs {inference.fmt_seeds((lo, hi))} paired seeds "
                                 f"({reach['power']:.0%} power)")


def check(kind: str, body, summary: pd.DataFrame, reach: dict | None = None) -> Outcome:
    """One summary predicate decided on its own (no other claims in the family: Holm over its own two tests)."""
    reach = _reach(reach)
    t = run_test(kind, body, summary, reach)
    a_s, a_c = inference.holm_adjust(np.array([t.p_support, t.p_contradict], float))
    return decide(t, a_s, a_c, 1 - _confidence(summary), reach)


def needs(kind: str, body, summary: pd.DataFrame | None = None, reach: dict | None = None,
          reads: str = "summary") -> str:
    """The claim in words (e.g. 'top-1 Δ ≥ -0.30 pp, same seeds and examples'), from its kind's registry entry."""
    k = REGISTRY[(reads, kind)]
    return k.needs(kind, body, summary, _reach(reach)) if k.needs else ""


def _reach(reach: dict | None) -> dict:
    """REACH with the given overrides, checked (a bad value is a ClaimsError: the CLI exits 2)."""
    unknown = sorted(set(reach or {}) - set(REACH) - {"size_alpha", "level", "sizing"})  # set by evaluate
    if unknown:
        raise ClaimsError(f"reach: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(REACH)}")
    out = {**REACH, **{k: v for k, v in (reach or {}).items() if v is not None}}
    if not 0 < out["power"] < 1:
        raise ClaimsError(f"reach: power must lie between 0 and 1 (e.g. 0.8), got {out['power']!r}")
    if isinstance(out["max_seeds"], bool) or not isinstance(out["max_seeds"], int) or out["max_seeds"] < 2:
        raise ClaimsError(f"reach: max_seeds must be a whole number ≥ 2, got {out['max_seeds']!r}")
    h = out["horizon_intervals"]
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < math.inf:
        raise ClaimsError(f"reach: horizon_intervals must be a number ≥ 0, got {h!r}")
    return out

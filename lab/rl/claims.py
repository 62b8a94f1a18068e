"""The RL study's claims (configs/claims_rl.yaml), decided on its runs (``python -m lab rl-claims``).

Every claim is one test or ``all`` of several; every test gives a one-sided p-value, and the file's p-values are
adjusted together (Holm: the family-wise error rate of the whole file at ``alpha``). The independent unit is the run:
its seed (paired across modes: the same seed draws the same problems) or, for the shape measurements, a random
model's seed. Kinds, on ``runs.csv`` (one row per run, lab/rl/aggregate.py) or ``shape.csv`` (lab/rl/shape.py):

* ``compare: {column, left, is: smaller|larger, right, effect}``: the paired (same seed) difference left - right,
  one-sided Student t. Supported when the adjusted p <= alpha; contradicted when it is not and the one-sided bound at
  the strictest Holm level excludes the declared ``effect`` in the claimed direction; else not resolved, with the paired seeds
  a declared effect of that size needs (sized from the declared effect and the measured spread), or out of reach
  when that exceeds ``max_seeds``. A difference shown but smaller than declared is supported, and its estimate says
  so.
* ``equivalent: {column, left, right, margin}``: TOST on the paired difference (the larger of the two one-sided
  p-values); contradicted when the whole (1 - 2 alpha_adj) interval lies outside +-margin.
* ``order: {column, modes: [a, b, c]}``: a < b < ... within each seed, each adjacent pair an exact sign test (ties
  count against the claim).
* ``greater_within: {table: runs|shape, modes, larger, smaller}``: column ``larger`` > ``smaller`` within each unit
  (each run of ``modes``; each shape unit), an exact sign test.
* ``ratio_within: {column, numerator, denominator, low, high}``: the per-seed log ratio; supported when its
  (1 - 2 alpha_adj) t-interval lies inside [log low, log high] (TOST), contradicted when wholly outside.
* ``fewer_skips: {left, right}``: per-seed skipped steps, left - right paired, one-sided t; with no skip in either
  mode the claim is out of reach (the scale never met the overflow point in the runs' length).

A claim may name another it ``requires`` (``tis-closes-gap`` needs a gap): when that one is not supported, it is out
of reach. A zero-width interval decides nothing: such a test is not resolved (or out of reach), never supported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy import stats as st

from lab.core import files
from lab.core.errors import ConfigError
from lab.study.inference import holm_adjust, seeds_for

__all__ = ["load_claims", "decide", "write_report", "KINDS"]

KINDS = {"compare": {"column", "left", "is", "right", "effect"}, "equivalent": {"column", "left", "right", "margin"},
         "order": {"column", "modes"}, "greater_within": {"table", "modes", "larger", "smaller"},
         "ratio_within": {"column", "numerator", "denominator", "low", "high"}, "fewer_skips": {"left", "right"}}
OPTIONAL = {"greater_within": {"modes"}}


@dataclass
class Test:
    """One test's outcome: its one-sided p (claimed direction), what would contradict it, the estimate shown."""
    claim: str
    kind: str
    what: str
    p: float = math.nan
    estimate: str = ""
    contradicted: bool = False
    undecidable: str = ""       # a reason the test cannot decide (zero width, no events), or ""
    needs: str = ""             # what would decide it
    extra: dict = field(default_factory=dict)


def load_claims(path) -> dict:
    """The claims file, validated before anything is decided: every problem names the claim."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"claims file {path} not found")
    data = yaml.safe_load(path.read_text()) or {}
    claims = data.get("claims")
    if not isinstance(claims, list) or not claims:
        raise ConfigError(f"{path}: expected `claims:` with a list of claims")
    seen = set()
    for c in claims:
        cid = c.get("id") if isinstance(c, dict) else None
        if not cid or cid in seen:
            raise ConfigError(f"{path}: every claim needs a unique id, got {c!r}")
        seen.add(cid)
        for key in ("text", "source"):
            if not c.get(key):
                raise ConfigError(f"{path}: claim {cid}: `{key}` is missing")
        for kind, spec in _tests(c):
            if kind not in KINDS:
                raise ConfigError(f"{path}: claim {cid}: unknown test {kind!r}; expected one of {', '.join(KINDS)}")
            need = KINDS[kind] - OPTIONAL.get(kind, set())
            if not isinstance(spec, dict) or need - set(spec) or set(spec) - KINDS[kind]:
                raise ConfigError(f"{path}: claim {cid}: {kind} needs exactly {sorted(KINDS[kind])}, got {spec!r}")
        if c.get("requires") and c["requires"] not in seen:
            raise ConfigError(f"{path}: claim {cid}: requires {c['requires']!r}, which is not a claim above it")
    return {"alpha": float(data.get("alpha", 0.05)), "power": float(data.get("power", 0.8)),
            "max_seeds": int(data.get("max_seeds", 20)), "claims": claims}


def _tests(claim: dict) -> list[tuple[str, dict]]:
    if "all" in claim:
        return [next(iter(t.items())) for t in claim["all"]]
    kinds = [k for k in claim if k not in ("id", "text", "source", "requires", "declared", "decides")]
    if len(kinds) != 1:
        raise ConfigError(f"claim {claim.get('id')}: expected one test or `all:`, got {kinds}")
    return [(kinds[0], claim[kinds[0]])]


def _by_seed(runs: pd.DataFrame, mode: str, column: str) -> pd.Series:
    rows = runs[runs["mode"] == mode]
    if rows.empty:
        raise ConfigError(f"mode {mode!r} has no runs in the table (modes: {', '.join(runs['mode'].unique())})")
    if column not in rows:
        raise ConfigError(f"column {column!r} is not in the runs table")
    return rows.set_index("seed")[column].astype(float)


def _paired(runs, column, left, right) -> np.ndarray:
    a, b = _by_seed(runs, left, column), _by_seed(runs, right, column)
    common = sorted(set(a.index) & set(b.index))
    return (a[common] - b[common]).to_numpy()


#: how a column's differences are shown: (factor, unit)
UNITS = {"solved_end": (100.0, " pp")}


def _shown(column: str, value: float) -> str:
    factor, unit = UNITS.get(column, (1.0, ""))
    return f"{factor * value:+.3g}{unit}"


def _t_one_sided(d: np.ndarray, larger: bool) -> tuple[float, float, float]:
    """(mean, se, one-sided p of mean > 0 if ``larger`` else mean < 0); p nan when the spread is zero."""
    n, mean = len(d), float(np.mean(d))
    se = float(np.std(d, ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    if not (se > 0):
        return mean, se, math.nan
    t = mean / se
    return mean, se, float(st.t.sf(t, n - 1) if larger else st.t.cdf(t, n - 1))


def _sign(wins: int, n: int) -> float:
    """Exact one-sided sign test: P(X >= wins), X ~ Binomial(n, 1/2)."""
    return float(st.binom.sf(wins - 1, n, 0.5)) if n else math.nan


def _compare(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
             level: float) -> Test:
    """Paired one-sided t on left - right; contradicted when the bound at ``level`` excludes the declared effect."""
    larger = spec["is"] == "larger"
    d = _paired(runs, spec["column"], spec["left"], spec["right"])
    mean, se, p = _t_one_sided(d, larger)
    test = Test(cid, kind, f"{spec['left']} {spec['is']} than {spec['right']} ({spec['column']})", p,
                f"Δ {_shown(spec['column'], mean)} (se {_shown(spec['column'], se)[1:]}, {len(d)} seeds)")
    effect = abs(float(spec["effect"]))
    if not math.isfinite(p):
        test.undecidable = "the paired differences have zero spread"
        return test
    # the one-sided bound on the side the claim needs: it rules out the declared effect when it stops short of it
    reach = st.t.ppf(1 - level, len(d) - 1) * se
    test.extra["excludes_effect"] = (mean + reach < effect) if larger else (mean - reach > -effect)
    test.needs = _sizing(effect, float(np.var(d, ddof=1)), level, cfg)
    return test


def _equivalent(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
                level: float) -> Test:
    """TOST on the paired difference against +-margin."""
    d = _paired(runs, spec["column"], spec["left"], spec["right"])
    m = float(spec["margin"])
    mean, se, _ = _t_one_sided(d, True)
    test = Test(cid, kind, f"{spec['left']} within ±{m:g} of {spec['right']} ({spec['column']})",
                estimate=f"Δ {_shown(spec['column'], mean)} (se {_shown(spec['column'], se)[1:]}, "
                         f"{len(d)} seeds)")
    if not (se > 0):
        test.undecidable = ("the runs are identical on every seed (Δ exactly 0): no spread to test against"
                            if not np.any(d) else "the paired differences have zero spread")
        return test
    df = len(d) - 1
    test.p = float(max(st.t.sf((mean + m) / se, df), st.t.cdf((mean - m) / se, df)))
    half = st.t.ppf(1 - level, df) * se
    test.contradicted = mean - half > m or mean + half < -m
    test.needs = _sizing(m, float(np.var(d, ddof=1)), level, cfg, equivalence=True)
    return test


def _order(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
           level: float) -> Test:
    """Each adjacent pair of modes an exact sign test within seeds."""
    modes, steps, ps = spec["modes"], [], []
    for lo, hi in zip(modes, modes[1:]):
        d = _paired(runs, spec["column"], hi, lo)
        wins, losses = int((d > 0).sum()), int((d < 0).sum())
        ps.append(_sign(wins, len(d)))
        steps.append(f"{lo} < {hi} in {wins} of {len(d)} seeds")
        if _sign(losses, len(d)) <= level:
            return Test(cid, kind, " < ".join(modes), max(ps), "; ".join(steps), contradicted=True)
    return Test(cid, kind, " < ".join(modes) + f" ({spec['column']})", max(ps), "; ".join(steps))


def _greater_within(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
                    level: float) -> Test:
    """Column ``larger`` > ``smaller`` within each unit, an exact sign test."""
    table = runs if spec["table"] == "runs" else shape
    if table is None:
        raise ConfigError(f"claim {cid}: needs the shape table (lab rl-shape)")
    rows = table[table["mode"].isin(spec["modes"])] if spec.get("modes") else table
    d = (rows[spec["larger"]].astype(float) - rows[spec["smaller"]].astype(float)).dropna().to_numpy()
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return Test(cid, kind, f"{spec['larger']} > {spec['smaller']} within each unit", _sign(wins, len(d)),
                f"in {wins} of {len(d)} units (median ratio "
                f"{float(np.median(rows[spec['larger']] / rows[spec['smaller']])):.3g})",
                contradicted=_sign(losses, len(d)) <= level)


def _ratio_within(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
                  level: float) -> Test:
    """The per-seed log ratio's interval inside [log low, log high] (TOST)."""
    a, b = _by_seed(runs, spec["numerator"], spec["column"]), _by_seed(runs, spec["denominator"], spec["column"])
    common = sorted(set(a.index) & set(b.index))
    r = np.log(a[common].to_numpy() / b[common].to_numpy())
    mean, se, _ = _t_one_sided(r, True)
    lo, hi = math.log(spec["low"]), math.log(spec["high"])
    test = Test(cid, kind, f"{spec['numerator']} / {spec['denominator']} within [{spec['low']:g}, "
                f"{spec['high']:g}] ({spec['column']})", estimate=f"geometric mean ratio {math.exp(mean):.3g} "
                f"({len(r)} seeds)")
    if not (se > 0):
        test.undecidable = "the log ratios have zero spread"
        return test
    df = len(r) - 1
    test.p = float(max(st.t.sf((mean - lo) / se, df), st.t.cdf((mean - hi) / se, df)))
    half = st.t.ppf(1 - level, df) * se
    test.estimate += f", its {100 * (1 - 2 * level):.1f}% interval [{math.exp(mean - half):.3g}, " \
                     f"{math.exp(mean + half):.3g}]"
    test.contradicted = mean - half > hi or mean + half < lo
    return test


def _fewer_skips(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
                 level: float) -> Test:
    """Per-seed skipped steps, left - right paired, one-sided t."""
    d = _paired(runs, "skipped_steps", spec["left"], spec["right"])
    left, right = _by_seed(runs, spec["left"], "skipped_steps"), _by_seed(runs, spec["right"], "skipped_steps")
    steps = int(_by_seed(runs, spec["left"], "steps").iloc[0])
    mean, se, p = _t_one_sided(d, False)
    test = Test(cid, kind, f"{spec['left']} skips fewer steps than {spec['right']}", p,
                f"skipped per run {left.mean():.2f} vs {right.mean():.2f} ({len(d)} seeds of {steps} steps)")
    if left.sum() == 0 and right.sum() == 0:
        test.undecidable = f"no step was skipped under either in {steps} steps"
        test.needs = "runs long enough for the scale to reach its overflow point under both rules"
    elif not (se > 0):
        test.undecidable = f"every seed's difference is the same ({d[0]:+g} skips): an interval of zero width"
        test.needs = "more seeds or longer runs, where the counts vary from seed to seed"
    else:
        test.contradicted = st.t.sf(mean / se, len(d) - 1) <= level
    return test


#: kind -> its test: (claim id, kind, spec, runs table, shape table, the claims file's settings, the strictest
#: Holm level) -> Test
TESTS = {"compare": _compare, "equivalent": _equivalent, "order": _order, "greater_within": _greater_within, "ratio_within": _ratio_within, "fewer_skips": _fewer_skips}


def _evaluate(cid: str, kind: str, spec: dict, runs: pd.DataFrame, shape: pd.DataFrame | None, cfg: dict,
              level: float) -> Test:
    """The test's p-value and estimate; ``level`` is the smallest Holm level it could face (sizing, bounds)."""
    if kind not in TESTS:
        raise ConfigError(f"claim {cid}: unknown test {kind!r}")
    return TESTS[kind](cid, kind, spec, runs, shape, cfg, level)


def _sizing(effect: float, var: float, level: float, cfg: dict, equivalence: bool = False) -> str:
    """Paired seeds a declared effect (or margin) of this size needs at the measured spread."""
    # seeds_for sizes a two-sided test at its alpha: 2 * level is the one-sided level here; TOST at a true
    # difference of 0 needs each one-sided test to pass at power (1 + power) / 2, approximately
    power = (1 + cfg["power"]) / 2 if equivalence else cfg["power"]
    if not cfg.get("sizing", True):  # the calibration simulation: verdicts only
        return ""
    n = seeds_for(effect, var, 0.0, 2 * level, power, cap=cfg["max_seeds"])
    if not math.isfinite(n) or n > cfg["max_seeds"]:
        return f"more than {cfg['max_seeds']} paired seeds at the measured spread"
    return f"about {n:g} paired seeds at the measured spread"


def decide(claims: dict, runs: pd.DataFrame, shape: pd.DataFrame | None) -> list[dict]:
    """Every claim's verdict: supported / contradicted / not resolved / out of reach, with its tests (Holm)."""
    alpha = claims["alpha"]
    flat = [(c, kind, spec) for c in claims["claims"] for kind, spec in _tests(c)]
    level = alpha / len(flat)  # Holm's first (strictest) level: what bounds and sizing are computed at
    tests = [_evaluate(c["id"], kind, spec, runs, shape, claims, level) for c, kind, spec in flat]
    finite = [i for i, t in enumerate(tests) if math.isfinite(t.p) and not t.undecidable]
    adjusted = np.full(len(tests), math.nan)
    if finite:
        # Holm over every test of the file; a test that cannot be computed counts as a test with p = 1
        p = np.array([tests[i].p if i in finite else 1.0 for i in range(len(tests))])
        adjusted = holm_adjust(p)
    out, verdicts = [], {}
    for c in claims["claims"]:
        mine = [(t, adjusted[i]) for i, t in enumerate(tests) if t.claim == c["id"]]
        states = [_state(t, q, alpha) for t, q in mine]
        if "contradicted" in states:
            verdict = "contradicted"
        elif all(s == "supported" for s in states):
            verdict = "supported"
        elif "out of reach" in states:
            verdict = "out of reach"
        else:
            verdict = "not resolved"
        if c.get("requires") and verdicts.get(c["requires"]) != "supported":
            # a claim about a gap (closing it) says nothing where the gap itself is not shown, whatever its own test
            verdict = "out of reach"
            why = f"needs {c['requires']} supported, which is {verdicts.get(c['requires'])}"
        else:
            why = ""
        verdicts[c["id"]] = verdict
        out.append({"id": c["id"], "text": c["text"], "source": c["source"], "verdict": verdict, "why": why,
                    "tests": [{"what": t.what, "estimate": t.estimate, "p": t.p, "p_holm": float(q),
                               "state": s, "needs": "; ".join(x for x in (t.undecidable, t.needs) if x)} for (t, q), s in zip(mine, states)]})
    return out


def _state(test: Test, q: float, alpha: float) -> str:
    shown = math.isfinite(q) and q <= alpha and not test.undecidable
    if test.contradicted or (test.extra.get("excludes_effect") and not shown):
        return "contradicted"
    if test.undecidable:
        return "out of reach" if test.needs else "not resolved"
    if math.isfinite(q) and q <= alpha:
        return "supported"
    return "out of reach" if test.needs.startswith("more than") else "not resolved"


def write_report(decided: list[dict], claims: dict, path: Path) -> None:
    lines = ["# The RL study's claims, decided", "",
             f"Declared before the runs (configs/claims_rl.yaml). Every test's p-value is adjusted with Holm's method "
             f"over all {sum(len(c['tests']) for c in decided)} tests of the file (family-wise error rate "
             f"{claims['alpha']:g}); the unit is the run (its seed, paired across modes) or, for the shape tests, a "
             "random model. Generated by `python -m lab rl-claims`.", "",
             "| claim | verdict | test | estimate | p (Holm) | what would decide it |", "|---|---|---|---|---|---|"]
    for c in decided:
        for i, t in enumerate(c["tests"]):
            head = (f"**{c['id']}**: {c['text']}", f"**{c['verdict']}**" + (f" ({c['why']})" if c["why"] else "")) \
                if i == 0 else ("", "")
            q = "—" if not math.isfinite(t["p_holm"]) else f"{t['p_holm']:.2g}"
            needs = t["needs"] if t["state"] in ("not resolved", "out of reach") else ""
            cells = (head[0], head[1], f"{t['what']} ({t['state']})", t["estimate"], q, needs)
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # a claim may say |d|
    lines += ["", "Sources:", ""] + [f"- {c['id']}: {c['source']}" for c in decided]
    files.atomic_write_text(path, "\n".join(lines) + "\n")

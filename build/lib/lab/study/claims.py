"""The source study's claims, stated as predicates over summary.csv and checked against it.

configs/claims.yaml lists the claims (its header documents the predicate kinds). Each is decided by the
paired intervals that lab/study/aggregate.py writes (delta ± half width of the Student-t interval of mode - FP32,
and the TOST equivalence column), never by a bare mean where an interval exists, and comes back as
supported / contradicted / not resolved / out of reach with the numbers that decide it, and what it needs to
be decided (`needs`). A claim the table cannot decide is sized: the paired seeds that would resolve it at the
observed spread with REACH["power"] (statsmodels' t-test power); when that is more than REACH["max_seeds"], or
no number of seeds would do it, or an overflow claim's runs are shorter than REACH["horizon_intervals"] growth
intervals of the policy, it is out of reach, with the reason in numbers. The README's findings section is
rendered from these records (`write_readme_section`), so it cannot drift from the tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from scipy import stats as st

from lab.core import files
from lab.core.config import STUDY_DEFAULTS
from lab.study import stats
from lab.study.stats import SEEDS_CAP, pooled_sd, sd_from_interval, seeds_needed
from lab.study.claims_file import (CLAIM_KEYS, COUNT_COLUMNS, DIRECTIONS, KINDS, METRICS, ROW_KEYS,  # noqa: F401
                                   ClaimsError, load_claims, load_summary, validate_claims)

SUPPORTED, CONTRADICTED, NOT_RESOLVED, OUT_OF_REACH = "supported", "contradicted", "not resolved", "out of reach"
#: what "in reach" means: the power a sized study should have, the most seeds (paired, or per row) it may
#: take, and how many of the policy's growth intervals an overflow claim's runs must span
REACH = dict(power=0.8, max_seeds=20, horizon_intervals=3)
#: used when summary.csv has no `confidence` / `<metric>_margin` column (older summaries)
DEFAULT_CONFIDENCE = float(STUDY_DEFAULTS["stats"]["confidence"])
DEFAULT_MARGINS = dict(STUDY_DEFAULTS["stats"]["margins"])
NAMES = {"top1": "top-1", "val_loss": "validation-loss"}
MARKERS = ("<!-- claims:start -->", "<!-- claims:end -->")


def legend(reach: dict | None = None) -> str:
    """The note under the claims table: how each verdict is reached, with the reach settings in force."""
    r = {**REACH, **(reach or {})}
    return ("supported / contradicted: the whole interval (paired Δ = mode − FP32 ± half width of its Student-t "
            "interval, from summary.csv; top-1 in pp, validation loss in nats; equivalence by the TOST column; "
            "overflow by the Welch interval of the difference of in-training overflow steps per 1000 steps) "
            "satisfies / violates the claim; not resolved: the interval straddles it or a row is missing, with "
            f"about how many seeds would resolve it at the observed spread ({r['power']:.0%} power, t-test); "
            f"out of reach: that needs more than {r['max_seeds']} seeds, no number of seeds would do it at that "
            "spread, or an overflow claim's runs are shorter than "
            f"{r['horizon_intervals']:g} growth intervals of the policy. needs: what the claim is about. "
            "Claims and their predicates: configs/claims.yaml.")


LEGEND = legend()


class _Unresolved(Exception):
    """Raised while evaluating when the table cannot decide (missing row, column or value): its reason."""


@dataclass(frozen=True)
class Outcome:
    verdict: str
    evidence: str


# --- evaluation -------------------------------------------------------------------------------------------
def evaluate(claims: list[dict], summary: pd.DataFrame, reach: dict | None = None) -> list[dict]:
    """One record per claim: id, text, source, verdict, needs, evidence (validated claims; missing rows
    resolve nothing). `reach` overrides REACH (power, max_seeds, horizon_intervals)."""
    reach = _reach(reach)
    records = []
    for claim in claims:
        kind = next(k for k in claim if k not in CLAIM_KEYS)
        out = check(kind, claim[kind], summary, reach)
        records.append({"id": claim["id"], "text": claim["text"], "source": claim["source"],
                        "verdict": out.verdict, "needs": needs(kind, claim[kind], summary, reach),
                        "evidence": out.evidence})
    return records


def _reach(reach: dict | None) -> dict:
    """REACH with the given overrides, checked (a bad value is a ClaimsError: the CLI exits 2)."""
    unknown = sorted(set(reach or {}) - set(REACH))
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


def check(kind: str, body, summary: pd.DataFrame, reach: dict | None = None) -> Outcome:
    """Decide one predicate; a row, column or interval the table lacks gives 'not resolved' with the reason."""
    try:
        return _CHECKS[kind](body, summary, _reach(reach))
    except _Unresolved as why:
        return Outcome(NOT_RESOLVED, str(why))


def _row(summary: pd.DataFrame, model: str, mode: str) -> pd.Series:
    rows = summary[(summary["model"] == model) & (summary["mode"] == mode)]
    if rows.empty:
        raise _Unresolved(f"no rows for {model} {mode}")
    return rows.iloc[0]


def _missing(row: pd.Series, column: str) -> _Unresolved:
    return _Unresolved(f"{row['model']} {row['mode']}: summary.csv has no {column} column (re-run aggregate)")


def _value(row: pd.Series, column: str) -> float:
    if column not in row.index:
        raise _missing(row, column)
    return float(pd.to_numeric(row[column], errors="coerce"))


def _optional(row: pd.Series, column: str) -> float:
    """A numeric column that older summaries lack: NaN when absent."""
    return _value(row, column) if column in row.index else math.nan


def _flag(row: pd.Series, column: str) -> bool:
    """A boolean column as pandas read it (bool, or 'True'/'False' text when the column also holds blanks)."""
    if column not in row.index:
        raise _missing(row, column)
    return str(row[column]).strip().lower() in ("true", "1", "1.0")


def _confidence(row: pd.Series) -> float:
    """The summary's confidence level (column `confidence`; 0.95, the study default, when absent)."""
    c = _optional(row, "confidence")
    return c if 0 < c < 1 else DEFAULT_CONFIDENCE


def _margin(row: pd.Series | None, metric: str) -> float:
    """The study's equivalence margin for `metric` (column `<metric>_margin`; the study default when absent)."""
    m = _optional(row, f"{metric}_margin") if row is not None else math.nan
    return m if math.isfinite(m) and m > 0 else DEFAULT_MARGINS[metric]


@dataclass(frozen=True)
class Delta:
    """One row's paired difference from FP32 on one metric, with its interval."""
    label: str
    metric: str
    delta: float
    ci: float
    n_pairs: float
    confidence: float = DEFAULT_CONFIDENCE
    margin: float = math.nan

    @property
    def lo(self) -> float:
        return self.delta - self.ci

    @property
    def hi(self) -> float:
        return self.delta + self.ci

    @property
    def sd(self) -> float:
        """The within-pair SD recovered from the interval (NaN with fewer than 2 pairs)."""
        return sd_from_interval(self.ci, self.n_pairs, self.confidence)

    def fmt(self, label: bool = True) -> str:
        scale, unit, digits, _ = METRICS[self.metric]
        ci = f"{scale * self.ci:.{digits}f}" if math.isfinite(self.ci) else "—"
        text = f"{scale * self.delta:+.{digits}f} ± {ci} {unit}"
        if not math.isfinite(self.ci):
            text += f" (no interval: {self.n_pairs:g} pair(s))"
        return f"{self.label} {self.metric} Δ {text}" if label else text


def _delta(summary: pd.DataFrame, model: str, mode: str, metric: str) -> Delta:
    row = _row(summary, model, mode)
    n = f"{metric}_n_pairs" if f"{metric}_n_pairs" in row.index else "n_pairs"
    d = Delta(f"{model} {mode}", metric, _value(row, f"{metric}_delta"), _value(row, f"{metric}_delta_ci"),
              _optional(row, n), _confidence(row), _margin(row, metric))
    if not math.isfinite(d.delta):
        raise _Unresolved(f"{d.label}: no paired {metric} values against fp32")
    return d


# --- reach: how many seeds would decide a claim that is not resolved ---------------------------------------
@dataclass(frozen=True)
class _Route:
    """One way more seeds could decide a claim: a t-test of `effect` (metric units; ≤ 0: no number of seeds
    would do it) against spread `sd`; `what` names the effect, `never` says why a route ≤ 0 is closed, `by` is
    '' for the claim's own test and else names the other verdict it would reach."""
    effect: float
    alternative: str  # "two-sided" or "larger" (one-sided, for a TOST)
    what: str
    never: str
    by: str = ""


@dataclass(frozen=True)
class _Spread:
    """The observed spread that sizes the routes: `sd` in metric units, shown with `fmt`; paired (one sample of
    differences over `n` pairs) or two rows compared (pooled sd, `n` the smaller row's seeds, seeds per row)."""
    sd: float
    n: float
    fmt: object  # callable: a value in metric units -> text with its unit
    paired: bool = True
    over: str = ""  # "2 pairs" / "4 and 3 seeds"
    alpha: float = 1 - DEFAULT_CONFIDENCE
    count: str = "pairs"  # what a row's n counts
    rule: str = "interval"  # what decides the claim (its t-test may need fewer seeds than the rule)


def _sized(out: Outcome, routes: list[_Route], spread: _Spread, reach: dict) -> Outcome:
    """A 'not resolved' outcome with the seeds that would resolve it (80% power by default), or 'out of
    reach' when no route needs at most reach['max_seeds'] seeds. Other verdicts pass through."""
    if out.verdict != NOT_RESOLVED:
        return out
    unit = "paired seeds" if spread.paired else "seeds per row"
    if not math.isfinite(spread.sd):
        return Outcome(NOT_RESOLVED, f"{out.evidence}; fewer than 2 {spread.count}: no spread to size the "
                                     "seeds needed")
    power, cap = reach["power"], reach["max_seeds"]
    sized = []
    for r in routes:
        d = math.inf if spread.sd == 0 and r.effect > 0 else r.effect / spread.sd if spread.sd > 0 else 0.0
        sized.append((seeds_needed(d, spread.alpha, power, r.alternative, spread.paired), r))
    n, best = min(sized, key=lambda x: (x[0], x[1].effect <= 0))
    by = f", {best.by}" if best.by else ""
    if not math.isfinite(n) and best.effect <= 0:
        return Outcome(OUT_OF_REACH, f"{out.evidence}; {'; '.join(r.never for _, r in sized)}")
    have = f"the study has {spread.n:g}" + ("" if spread.paired else " per row")
    if n > cap:
        about = f"about {n:g}" if math.isfinite(n) else f"more than {SEEDS_CAP:,}"
        return Outcome(OUT_OF_REACH, f"{out.evidence}; {best.what} at the observed spread (sd "
                                     f"{spread.fmt(spread.sd)} over {spread.over}) needs {about} {unit} "
                                     f"({power:.0%} power{by}); {have}, at most {cap} in reach")
    note = ""
    if n <= spread.n:  # e.g. `compare`'s separated intervals ask more than a t-test on the difference
        note = f" by a t-test at this effect; the {spread.rule} needs more than the study's {spread.n:g}"
    return Outcome(NOT_RESOLVED, f"{out.evidence}; about {n:g} {unit} would resolve it ({power:.0%} power{by})"
                                 f"{note}")


def _fmt_metric(metric: str, signed: bool = False):
    scale, unit, digits, _ = METRICS[metric]
    return lambda v: f"{scale * v:{'+' if signed else ''}.{digits}f} {unit}"


def _paired_spread(d: Delta) -> _Spread:
    return _Spread(d.sd, d.n_pairs, _fmt_metric(d.metric), True, f"{d.n_pairs:g} pairs", 1 - d.confidence)


# --- the predicate kinds ----------------------------------------------------------------------------------
def _bound(body: dict, summary: pd.DataFrame, reach: dict) -> Outcome:
    """Supported when the whole interval meets the bound, contradicted when the whole interval misses it."""
    d = _delta(summary, body["model"], body["mode"], body["metric"])
    scale, unit, digits, _ = METRICS[d.metric]
    if "at_least" in body:
        x, sign = body["at_least"], "≥"
        ok, bad = d.lo >= x, d.hi < x
    else:
        x, sign = body["at_most"], "≤"
        ok, bad = d.hi <= x, d.lo > x
    interval = (f" = [{scale * d.lo:+.{digits}f}, {scale * d.hi:+.{digits}f}]"
                if math.isfinite(d.ci) else "")
    evidence = f"{d.fmt()}{interval}, claim Δ {sign} {scale * x:+.{digits}f} {unit}"
    out = Outcome(SUPPORTED if ok else CONTRADICTED if bad else NOT_RESOLVED, evidence)
    # the interval clears the bound once t * sd / sqrt(n) < |Δ - x|: a two-sided test of Δ = x at 1 - confidence
    gap = abs(d.delta - x)
    fmt = _fmt_metric(d.metric)
    return _sized(out, [_Route(gap, "two-sided", f"a {fmt(gap)} distance to the bound",
                               "Δ sits on the bound: no number of seeds moves the interval off it")],
                  _paired_spread(d), reach)


def _compare(body: dict, summary: pd.DataFrame, reach: dict) -> Outcome:
    """Supported when the two intervals are separated in the claimed direction, contradicted the other way."""
    m = body["metric"]
    a = _delta(summary, body["left"]["model"], body["left"]["mode"], m)
    b = _delta(summary, body["right"]["model"], body["right"]["mode"], m)
    below, above = a.hi < b.lo, a.lo > b.hi
    ok, bad = (below, above) if body["is"] == "smaller" else (above, below)
    evidence = f"{a.fmt()} vs {b.label} {b.fmt(label=False)}, claim: {body['is']}"
    out = Outcome(SUPPORTED if ok else CONTRADICTED if bad else NOT_RESOLVED, evidence)
    fmt, gap = _fmt_metric(m), abs(a.delta - b.delta)
    spread = _Spread(pooled_sd(a.sd, a.n_pairs, b.sd, b.n_pairs), min(a.n_pairs, b.n_pairs), fmt, False,
                     f"{a.n_pairs:g} and {b.n_pairs:g} pairs", 1 - a.confidence, "pairs", "separated-intervals rule")
    return _sized(out, [_Route(gap, "two-sided", f"a {fmt(gap)} difference between the two Δs",
                               "the two Δs are equal: no number of seeds separates them")], spread, reach)


def _direction(d: Delta) -> str:
    """'cost' / 'gain' when the interval excludes 0 (lower top-1 or higher loss is a cost), else ''."""
    if not stats.resolved(d.delta, d.ci):
        return ""
    return "gain" if (d.delta > 0) == METRICS[d.metric][3] else "cost"


def _tost(body: dict, summary: pd.DataFrame) -> tuple[Delta, bool, str, str]:
    d = _delta(summary, body["model"], body["mode"], body["metric"])
    eq = _flag(_row(summary, body["model"], body["mode"]), f"{body['metric']}_equivalent")
    direction = _direction(d)
    evidence = (f"{d.fmt()}, {direction + ' resolved' if direction else 'no resolved difference'}, "
                f"TOST {'equivalent' if eq else 'not equivalent'}")
    return d, eq, direction, evidence


def _is_cost(d: Delta) -> bool:
    """The observed mean is on the cost side (lower top-1, higher loss)."""
    return d.delta != 0 and (d.delta > 0) != METRICS[d.metric][3]


def _tost_route(d: Delta, by: str = "") -> _Route:
    """TOST, approximated by one one-sided test at alpha: margin - |Δ| (≤ 0: Δ outside the margin)."""
    fmt = _fmt_metric(d.metric)
    room = d.margin - abs(d.delta)
    return _Route(room, "larger", f"equivalence {fmt(room)} inside the ±{fmt(d.margin)} margin",
                  f"Δ {_fmt_metric(d.metric, True)(d.delta)} lies outside the ±{fmt(d.margin)} margin: no number of "
                  "seeds shows equivalence", by)


def _diff_route(d: Delta, by: str = "") -> _Route:
    """Resolving Δ against 0 (two-sided at 1 - confidence)."""
    fmt = _fmt_metric(d.metric)
    return _Route(abs(d.delta), "two-sided", f"a {fmt(abs(d.delta))} difference",
                  "Δ is 0: no number of seeds resolves a difference", by)


def _equivalent(body: dict, summary: pd.DataFrame, reach: dict) -> Outcome:
    """Supported when TOST shows equivalence within the study's margin (a resolved cost inside the margin
    still counts: the margin was fixed in advance as what does not matter); contradicted by a cost beyond it."""
    d, eq, direction, evidence = _tost(body, summary)
    out = Outcome(SUPPORTED if eq else CONTRADICTED if direction == "cost" else NOT_RESOLVED, evidence)
    routes = [_tost_route(d)] + ([_diff_route(d, "by resolving the cost, which contradicts it")]
                                 if _is_cost(d) else [])
    return _sized(out, routes, _paired_spread(d), reach)


def _cost(body: dict, summary: pd.DataFrame, reach: dict) -> Outcome:
    """Supported by a resolved cost; contradicted by a resolved gain or, absent a resolved cost, equivalence."""
    d, eq, direction, evidence = _tost(body, summary)
    if direction == "cost":
        return Outcome(SUPPORTED, evidence)
    out = Outcome(CONTRADICTED if eq or direction == "gain" else NOT_RESOLVED, evidence)
    routes = [_diff_route(d), _tost_route(d, "by TOST equivalence, which contradicts it")]
    return _sized(out, routes, _paired_spread(d), reach)


def _horizon(row: pd.Series, reach: dict) -> str:
    """'' when the row's runs span the horizon (or it has no growth interval: a static policy), else why not."""
    interval, steps = _value(row, "growth_interval"), _value(row, "steps_mean")
    if not math.isfinite(interval):
        return ""
    if not math.isfinite(steps):
        raise _Unresolved(f"{row['model']} {row['mode']}: no steps_mean value")
    h = reach["horizon_intervals"]
    if steps >= h * interval:
        return ""
    return (f"{row['model']} {row['mode']}: runs are {steps:.0f} steps; {row['mode']} grows every "
            f"{interval:.0f} steps: a horizon of {h:g} growth intervals needs ≥ {h * interval:.0f} steps")


def _more_overflow(body: dict, summary: pd.DataFrame, reach: dict) -> Outcome:
    """In-training overflow steps per 1000 steps, once both rows' runs span the horizon (horizon_intervals ×
    the policy's growth interval): supported / contradicted when the Welch interval of the difference of the
    two rows' means excludes 0. The old per-run count columns have no spread: a difference of 1 decides."""
    column = body.get("column", COUNT_COLUMNS[0])
    rows = [_row(summary, s["model"], s["mode"]) for s in (body["left"], body["right"])]
    for row in rows:
        if column not in row.index:
            raise _missing(row, column)
    has_horizon = all(c in rows[0].index for c in ("growth_interval", "steps_mean"))
    if column == COUNT_COLUMNS[0] or has_horizon:
        short = [why for why in (_horizon(row, reach) for row in rows) if why]
        if short:
            return Outcome(OUT_OF_REACH, "; ".join(short))
    (la, lb) = (f"{r['model']} {r['mode']}" for r in rows)
    a, b = (_value(r, column) for r in rows)
    for label, v in ((la, a), (lb, b)):
        if not math.isfinite(v):
            raise _Unresolved(f"{label}: no {column} value")
    if column != COUNT_COLUMNS[0]:
        evidence = (f"{la} {column} {a:.1f} vs {lb} {b:.1f} per run (counts the initial descent too"
                    f"{'' if has_horizon else '; horizon not checked: no growth_interval column'}), "
                    "claim: first ≥ second + 1")
        return Outcome(SUPPORTED if a - b >= 1 else CONTRADICTED if b - a >= 1 else NOT_RESOLVED, evidence)
    (sa, sb), (na, nb) = ((_value(r, f"{column}_sd") for r in rows), (_value(r, "n_seeds") for r in rows))
    conf = _confidence(rows[0])
    diff = a - b
    evidence = f"{la} {column} {a:.2f} vs {lb} {b:.2f} in-training overflow steps per 1000 steps"
    va, vb = (s ** 2 / n if n >= 2 else math.nan for s, n in ((sa, na), (sb, nb)))
    if not (math.isfinite(va) and math.isfinite(vb)):
        out = Outcome(NOT_RESOLVED, f"{evidence}, difference {diff:+.2f} (no interval: {na:g} and {nb:g} "
                                    "seed(s)), claim: first > second")
    else:
        se = math.sqrt(va + vb)
        half = 0.0 if se == 0 else float(
            st.t.ppf((1 + conf) / 2, (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))) * se)
        evidence += (f", difference {diff:+.2f} ± {half:.2f} (Welch, {conf:.0%}) = "
                     f"[{diff - half:+.2f}, {diff + half:+.2f}], claim: first > second")
        out = Outcome(SUPPORTED if diff - half > 0 else CONTRADICTED if diff + half < 0 else NOT_RESOLVED,
                      evidence)
    fmt = lambda v: f"{v:.2f} per 1k steps"  # noqa: E731
    spread = _Spread(pooled_sd(sa, na, sb, nb), min(na, nb), fmt, False, f"{na:g} and {nb:g} seeds", 1 - conf,
                     "seeds", "Welch interval")
    return _sized(out, [_Route(abs(diff), "two-sided", f"a {fmt(abs(diff))} difference",
                               "the two rates are equal: no number of seeds separates them")], spread, reach)


def _all(body: list, summary: pd.DataFrame, reach: dict) -> Outcome:
    """Contradicted when any part is; else supported when every part is; else out of reach when any part is;
    else not resolved. The evidence lists each part's verdict."""
    parts = [check(*next(iter(item.items())), summary, reach) for item in body]
    verdicts = {p.verdict for p in parts}
    verdict = (CONTRADICTED if CONTRADICTED in verdicts else SUPPORTED if verdicts == {SUPPORTED}
               else OUT_OF_REACH if OUT_OF_REACH in verdicts else NOT_RESOLVED)
    return Outcome(verdict, "; ".join(f"{p.verdict}: {p.evidence}" for p in parts))


_CHECKS = {"bound": _bound, "compare": _compare, "equivalent": _equivalent, "cost": _cost,
           "more_overflow": _more_overflow, "all": _all}


# --- what each claim needs to be decided -------------------------------------------------------------------
def needs(kind: str, body, summary: pd.DataFrame | None = None, reach: dict | None = None) -> str:
    """The metric and the smallest difference a claim is about, in words (e.g. 'top-1 Δ ≥ -0.30 pp, paired
    over seeds'); the equivalence margin is the summary's (`<metric>_margin`) or the study default."""
    reach = _reach(reach)
    if kind == "all":  # each part prefixed with its row where it has one
        parts = (next(iter(item.items())) for item in body)
        return "; ".join((f"{b['model']} {b['mode']}: " if {"model", "mode"} <= set(b) else "")
                         + needs(k, b, summary, reach) for k, b in parts)
    if kind == "more_overflow":
        column = body.get("column", COUNT_COLUMNS[0])
        if column == COUNT_COLUMNS[0]:
            return (f"in-training overflow rate per 1000 steps, horizon ≥ {reach['horizon_intervals']:g} growth "
                    "intervals, Welch interval over seeds")
        return f"{column} per run (counts the initial descent too), a difference ≥ 1"
    metric = body["metric"]
    scale, unit, digits, _ = METRICS[metric]
    name = NAMES[metric]
    if kind == "bound":
        limit = "at_least" if "at_least" in body else "at_most"
        sign = "≥" if limit == "at_least" else "≤"
        return f"{name} Δ {sign} {scale * body[limit]:+.{digits}f} {unit}, paired over seeds"
    if kind == "compare":
        left, right = (f"{body[s]['model']} {body[s]['mode']}" for s in ("left", "right"))
        sign = "<" if body["is"] == "smaller" else ">"
        return f"{name} Δ of {left} {sign} Δ of {right}, separated intervals"
    if kind == "cost":
        return f"{name} cost > 0 {unit}, paired over seeds"
    row = None
    if summary is not None:
        try:
            row = _row(summary, body["model"], body["mode"])
        except _Unresolved:
            pass
    return f"{name} equivalence within ±{scale * _margin(row, metric):.{digits}f} {unit} (TOST), paired over seeds"


# --- output -----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def to_markdown(records: list[dict], reach: dict | None = None) -> str:
    """claim | verdict | needs | evidence, one row per claim, and the legend (for the reach settings used)."""
    lines = ["| claim | verdict | needs | evidence |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {_cell(r['text'])} (`{r['id']}`) | **{r['verdict']}** | {_cell(r.get('needs', ''))} | "
                     f"{_cell(r['evidence'])} |")
    return "\n".join(lines + ["", legend(reach)]) + "\n"


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

"""The source study's claims, stated as predicates over summary.csv and checked against it.

configs/claims.yaml lists the claims (its header documents the predicate kinds). Each is decided by the
paired intervals that lab/aggregate.py writes (delta ± half width of the Student-t interval of mode - FP32,
and the TOST equivalence column), never by a bare mean where an interval exists, and comes back as
supported / contradicted / not resolved with the numbers that decide it. The README's findings section is
rendered from these records (`write_readme_section`), so it cannot drift from the tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from lab import runio, stats

SUPPORTED, CONTRADICTED, NOT_RESOLVED = "supported", "contradicted", "not resolved"
#: metric -> (display scale, unit, digits, higher is better): top-1 is stored as a fraction, shown in pp
METRICS = {"top1": (100.0, "pp", 2, True), "val_loss": (1.0, "nats", 3, False)}
COUNT_COLUMNS = ("overflow_steps", "skipped_pct")
CLAIM_KEYS = ("id", "text", "source")
ROW_KEYS = ("model", "mode")
#: predicate kind -> (required keys, optional keys); `all` holds a list of predicates instead
KINDS = {
    "bound": ({"model", "mode", "metric"}, {"at_least", "at_most"}),
    "compare": ({"metric", "left", "is", "right"}, set()),
    "equivalent": ({"model", "mode", "metric"}, set()),
    "cost": ({"model", "mode", "metric"}, set()),
    "more_overflow": ({"left", "right"}, {"column"}),
    "all": (set(), set()),
}
DIRECTIONS = ("larger", "smaller")
MARKERS = ("<!-- claims:start -->", "<!-- claims:end -->")
LEGEND = ("supported / contradicted: the whole interval (paired Δ = mode − FP32 ± half width of its Student-t "
          "interval, from summary.csv; top-1 in pp, validation loss in nats; equivalence by the TOST column) "
          "satisfies / violates the claim; not resolved: the interval straddles it or a row is missing. "
          "Claims and their predicates: configs/claims.yaml.")


class ClaimsError(ValueError):
    """A claims file or summary that cannot be checked; the message names the claim and what is allowed."""


class _Unresolved(Exception):
    """Raised while evaluating when the table cannot decide (missing row, column or value): its reason."""


@dataclass(frozen=True)
class Outcome:
    verdict: str
    evidence: str


# --- loading and validation -------------------------------------------------------------------------------
def load_claims(path) -> list[dict]:
    """Read and validate a claims file; a missing file or bad YAML is a ClaimsError (the CLI exits 2)."""
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"claims file {path} not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClaimsError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return validate_claims(raw, str(path))


def validate_claims(raw, where: str = "claims") -> list[dict]:
    """Check the list of claims up front, so a typo fails with its claim id instead of as 'not resolved'."""
    if not isinstance(raw, list) or not raw:
        raise ClaimsError(f"{where}: expected a non-empty list of claims")
    seen: set = set()
    for i, claim in enumerate(raw):
        cid = _validate_claim(claim, i, where)
        if cid in seen:
            raise ClaimsError(f"{where}: claim id {cid!r} appears twice")
        seen.add(cid)
    return raw


def _validate_claim(claim, i: int, where: str) -> str:
    if not isinstance(claim, dict):
        raise ClaimsError(f"{where}: claim #{i + 1} is not a mapping")
    cid = claim.get("id")
    if not isinstance(cid, str) or not cid:
        raise ClaimsError(f"{where}: claim #{i + 1} needs an `id` (a string)")
    for key in ("text", "source"):
        if not isinstance(claim.get(key), str) or not claim[key].strip():
            raise ClaimsError(f"claim {cid}: needs `{key}` (a string)")
    kinds = [k for k in claim if k not in CLAIM_KEYS]
    if len(kinds) != 1:
        raise ClaimsError(f"claim {cid}: needs exactly one predicate, got {', '.join(map(str, kinds)) or 'none'}; "
                          f"allowed: {', '.join(KINDS)} (besides {', '.join(CLAIM_KEYS)})")
    _validate_predicate(kinds[0], claim[kinds[0]], cid)
    return cid


def _validate_predicate(kind, body, cid: str) -> None:
    """One predicate (recursively for `all`): known kind, known keys, allowed values."""
    if kind not in KINDS:
        raise ClaimsError(f"claim {cid}: unknown predicate kind {kind!r}; allowed: {', '.join(KINDS)}")
    if kind == "all":
        if not isinstance(body, list) or not body:
            raise ClaimsError(f"claim {cid}: `all` needs a non-empty list of predicates")
        for item in body:
            if not isinstance(item, dict) or len(item) != 1:
                raise ClaimsError(f"claim {cid}: each item of `all` is one predicate, e.g. `- cost: {{...}}`; "
                                  f"allowed kinds: {', '.join(KINDS)}")
            _validate_predicate(*next(iter(item.items())), cid)
        return
    required, optional = KINDS[kind]
    _check_keys(body, required, optional, f"claim {cid}: {kind}")
    if "metric" in body:
        _check_choice(body["metric"], METRICS, f"claim {cid}: {kind}.metric")
    for key in ROW_KEYS:
        if key in body:
            _check_name(body[key], f"claim {cid}: {kind}.{key}")
    for side in ("left", "right"):
        if side in body:
            _check_keys(body[side], set(ROW_KEYS), set(), f"claim {cid}: {kind}.{side}")
            for key in ROW_KEYS:
                _check_name(body[side][key], f"claim {cid}: {kind}.{side}.{key}")
    if kind == "bound":
        limits = [k for k in ("at_least", "at_most") if k in body]
        if len(limits) != 1:
            raise ClaimsError(f"claim {cid}: bound needs exactly one of at_least, at_most")
        if isinstance(body[limits[0]], bool) or not isinstance(body[limits[0]], (int, float)):
            raise ClaimsError(f"claim {cid}: bound.{limits[0]} must be a number (top1 as a fraction: -0.003)")
    if kind == "compare":
        _check_choice(body["is"], DIRECTIONS, f"claim {cid}: compare.is")
    if kind == "more_overflow":
        _check_choice(body.get("column", COUNT_COLUMNS[0]), COUNT_COLUMNS, f"claim {cid}: more_overflow.column")


def _check_keys(body, required: set, optional: set, where: str) -> None:
    allowed = ", ".join(sorted(required | optional))
    if not isinstance(body, dict):
        raise ClaimsError(f"{where}: expected a mapping with keys {allowed}")
    unknown = sorted(set(body) - required - optional, key=str)
    if unknown:
        raise ClaimsError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {allowed}")
    missing = sorted(required - set(body))
    if missing:
        raise ClaimsError(f"{where}: missing key(s) {', '.join(missing)}; required: {', '.join(sorted(required))}")


def _check_choice(value, allowed, where: str) -> None:
    if value not in allowed:
        raise ClaimsError(f"{where}: {value!r} is not allowed; allowed: {', '.join(allowed)}")


def _check_name(value, where: str) -> None:
    if not isinstance(value, str) or not value:
        raise ClaimsError(f"{where}: expected a name (string), got {value!r}")


def load_summary(path) -> pd.DataFrame:
    """summary.csv as written by `python -m lab aggregate`; missing or shapeless files are errors."""
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"summary {path} not found: run `python -m lab aggregate` (or snakemake) first")
    try:
        table = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as e:
        raise ClaimsError(f"{path}: not a readable CSV ({' '.join(str(e).split())})") from None
    missing = [c for c in ROW_KEYS if c not in table]
    if missing:
        raise ClaimsError(f"{path}: no {', '.join(missing)} column: not a summary table")
    return table


# --- evaluation -------------------------------------------------------------------------------------------
def evaluate(claims: list[dict], summary: pd.DataFrame) -> list[dict]:
    """One record per claim: id, text, source, verdict, evidence (validated claims; missing rows resolve nothing)."""
    records = []
    for claim in claims:
        kind = next(k for k in claim if k not in CLAIM_KEYS)
        out = check(kind, claim[kind], summary)
        records.append({"id": claim["id"], "text": claim["text"], "source": claim["source"],
                        "verdict": out.verdict, "evidence": out.evidence})
    return records


def check(kind: str, body, summary: pd.DataFrame) -> Outcome:
    """Decide one predicate; a row, column or interval the table lacks gives 'not resolved' with the reason."""
    try:
        return _CHECKS[kind](body, summary)
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


def _flag(row: pd.Series, column: str) -> bool:
    """A boolean column as pandas read it (bool, or 'True'/'False' text when the column also holds blanks)."""
    if column not in row.index:
        raise _missing(row, column)
    return str(row[column]).strip().lower() in ("true", "1", "1.0")


@dataclass(frozen=True)
class Delta:
    """One row's paired difference from FP32 on one metric, with its interval."""
    label: str
    metric: str
    delta: float
    ci: float
    n_pairs: float

    @property
    def lo(self) -> float:
        return self.delta - self.ci

    @property
    def hi(self) -> float:
        return self.delta + self.ci

    def fmt(self, label: bool = True) -> str:
        scale, unit, digits, _ = METRICS[self.metric]
        ci = f"{scale * self.ci:.{digits}f}" if math.isfinite(self.ci) else "—"
        text = f"{scale * self.delta:+.{digits}f} ± {ci} {unit}"
        if not math.isfinite(self.ci):
            text += f" (no interval: {self.n_pairs:g} pair(s))"
        return f"{self.label} {self.metric} Δ {text}" if label else text


def _delta(summary: pd.DataFrame, model: str, mode: str, metric: str) -> Delta:
    row = _row(summary, model, mode)
    d = Delta(f"{model} {mode}", metric, _value(row, f"{metric}_delta"), _value(row, f"{metric}_delta_ci"),
              _value(row, f"{metric}_n_pairs") if f"{metric}_n_pairs" in row.index else math.nan)
    if not math.isfinite(d.delta):
        raise _Unresolved(f"{d.label}: no paired {metric} values against fp32")
    return d


def _bound(body: dict, summary: pd.DataFrame) -> Outcome:
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
    return Outcome(SUPPORTED if ok else CONTRADICTED if bad else NOT_RESOLVED, evidence)


def _compare(body: dict, summary: pd.DataFrame) -> Outcome:
    """Supported when the two intervals are separated in the claimed direction, contradicted the other way."""
    m = body["metric"]
    a = _delta(summary, body["left"]["model"], body["left"]["mode"], m)
    b = _delta(summary, body["right"]["model"], body["right"]["mode"], m)
    below, above = a.hi < b.lo, a.lo > b.hi
    ok, bad = (below, above) if body["is"] == "smaller" else (above, below)
    evidence = f"{a.fmt()} vs {b.label} {b.fmt(label=False)}, claim: {body['is']}"
    return Outcome(SUPPORTED if ok else CONTRADICTED if bad else NOT_RESOLVED, evidence)


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


def _equivalent(body: dict, summary: pd.DataFrame) -> Outcome:
    """Supported when TOST shows equivalence within the study's margin (a resolved cost inside the margin
    still counts: the margin was fixed in advance as what does not matter); contradicted by a cost beyond it."""
    _, eq, direction, evidence = _tost(body, summary)
    return Outcome(SUPPORTED if eq else CONTRADICTED if direction == "cost" else NOT_RESOLVED, evidence)


def _cost(body: dict, summary: pd.DataFrame) -> Outcome:
    """Supported by a resolved cost; contradicted by a resolved gain or, absent a resolved cost, equivalence."""
    _, eq, direction, evidence = _tost(body, summary)
    if direction == "cost":
        return Outcome(SUPPORTED, evidence)
    return Outcome(CONTRADICTED if eq or direction == "gain" else NOT_RESOLVED, evidence)


def _more_overflow(body: dict, summary: pd.DataFrame) -> Outcome:
    """Per-run means (the summary has no interval for counts): a difference of at least 1 decides."""
    column = body.get("column", COUNT_COLUMNS[0])
    sides = [(f"{s['model']} {s['mode']}", _value(_row(summary, s["model"], s["mode"]), column))
             for s in (body["left"], body["right"])]
    (la, a), (lb, b) = sides
    for label, v in sides:
        if not math.isfinite(v):
            raise _Unresolved(f"{label}: no {column} value")
    evidence = f"{la} {column} {a:.1f} vs {lb} {b:.1f} per run, claim: first ≥ second + 1"
    return Outcome(SUPPORTED if a - b >= 1 else CONTRADICTED if b - a >= 1 else NOT_RESOLVED, evidence)


def _all(body: list, summary: pd.DataFrame) -> Outcome:
    """Supported when every part is, contradicted when any part is; the evidence lists each part's verdict."""
    parts = [check(*next(iter(item.items())), summary) for item in body]
    verdicts = {p.verdict for p in parts}
    verdict = (CONTRADICTED if CONTRADICTED in verdicts else SUPPORTED if verdicts == {SUPPORTED}
               else NOT_RESOLVED)
    return Outcome(verdict, "; ".join(f"{p.verdict}: {p.evidence}" for p in parts))


_CHECKS = {"bound": _bound, "compare": _compare, "equivalent": _equivalent, "cost": _cost,
           "more_overflow": _more_overflow, "all": _all}


# --- output -----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def to_markdown(records: list[dict]) -> str:
    """claim | verdict | evidence, one row per claim, and the legend."""
    lines = ["| claim | verdict | evidence |", "|---|---|---|"]
    for r in records:
        lines.append(f"| {_cell(r['text'])} (`{r['id']}`) | **{r['verdict']}** | {_cell(r['evidence'])} |")
    return "\n".join(lines + ["", LEGEND]) + "\n"


def to_text(records: list[dict]) -> str:
    """What the CLI prints: the verdict, the claim, and its evidence indented below."""
    return "".join(f"{r['verdict']:<13} {r['id']}: {r['text']}\n{'':14}{r['evidence']}\n" for r in records)


def write_readme_section(readme_path, markdown: str) -> bool:
    """Replace the text between the claims markers (kept) with `markdown`; True when the file changed.

    Markers missing, or out of order, are an error rather than a silent append: the section's place in the
    README is an editorial choice.
    """
    path = Path(readme_path)
    if not path.is_file():
        raise ClaimsError(f"{path} not found")
    text = path.read_text()
    start, end = MARKERS
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise ClaimsError(f"{path}: needs the markers {start} and {end} (in that order) around the claims section")
    new = f"{text[:i + len(start)]}\n{markdown.strip()}\n{text[j:]}"
    if new == text:
        return False
    runio.atomic_write_text(path, new)
    return True

"""Reading a claims file (configs/claims*.yaml, every study's) and the summary table it is checked against.

Every problem is a ClaimsError naming the claim and what is allowed, raised before any claim is evaluated, so a
typo fails with its claim id instead of coming back as "not resolved" (lab/study/claims/ evaluates). The kinds and
their keys are the registry's (lab/study/claims/base.py); the summary's kinds have their values checked too.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from lab.core import runfiles
# the kinds of these four register on import
from lab.study.claims import detection as _detection_kinds  # noqa: F401
from lab.study.claims import runs as _runs_kinds, summary as _summary_kinds, trajectory as _traj_kinds  # noqa: F401
from lab.study.claims.base import CLAIM_KEYS, REACH, TABLES, ClaimsError, kinds  # noqa: F401
from lab.study.claims.summary import COUNT_COLUMNS, DIRECTIONS, METRICS, SHARE_COLUMNS  # noqa: F401

ROW_KEYS = ("model", "mode")
#: a claims file's top-level keys: the claims, the margins declared before the runs, the group-sequential plans, the
#: trajectory's settings, the family's error rate and sizing (default: the summary's confidence; REACH), and the
#: table its claims read (default: the caller's, summary for `lab claims`, runs for `lab rl-claims`)
TOP_KEYS = ("declared", "claims", "sequential", "trajectory", "alpha", "power", "max_seeds", "reads")


def _read(path):
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"claims file {path} not found")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClaimsError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None


def load_claims(path, reads: str = "summary") -> list[dict]:
    """Read and validate a claims file's claims (the file is a mapping with `claims:` and the TOP_KEYS, or, in the
    older form, the list of claims alone); a missing file or bad YAML is a ClaimsError (the CLI exits 2)."""
    return load_file(path, reads)["claims"]


def load_file(path, reads: str = "summary") -> dict:
    """The claims file as {claims, reads, alpha, power, max_seeds} (the last three where the file sets them), checked
    whole; ``reads``: the table its claims read unless the file or a claim says otherwise."""
    raw = _read(path)
    out: dict = {"reads": reads}
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - set(TOP_KEYS), key=str)
        if unknown:
            raise ClaimsError(f"{path}: unknown top-level key(s) {', '.join(map(str, unknown))}; allowed: "
                              f"{', '.join(TOP_KEYS)}")
        validate_declared(raw.get("declared"), str(path))
        _trajectory(raw, path)
        validate_sequential(raw.get("sequential"), str(path))
        out["reads"] = raw.get("reads", reads)
        _check_choice(out["reads"], TABLES, f"{path}: reads")
        out.update(_settings(raw, str(path)))
        raw = raw.get("claims")
    out["claims"] = validate_claims(raw, str(path), out["reads"])
    return out


def _settings(raw: dict, where: str) -> dict:
    """The file's alpha (0 < alpha < 1), power (0 < power < 1) and max_seeds (a whole number >= 2), where set."""
    out = {}
    for key, ok in (("alpha", lambda v: 0 < v < 1), ("power", lambda v: 0 < v < 1),
                    ("max_seeds", lambda v: isinstance(v, int) and v >= 2)):
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ClaimsError(f"{where}: {key}: {v!r} is not allowed (alpha and power between 0 and 1, "
                                  "max_seeds a whole number >= 2)")
            out[key] = v
    return out


def load_declared(path) -> dict:
    """{family: {metric: {margin, effect, reason}}}: the margins and smallest effects of interest declared before
    the runs (the `declared:` block; {} for a file without one)."""
    raw = _read(path)
    return validate_declared(raw.get("declared"), str(path)) if isinstance(raw, dict) else {}


def load_trajectory(path) -> dict | None:
    """The `trajectory:` block (settled window, target loss: lab/study/trajectory.py) over its defaults, or None for
    a file without one (the study then has no trajectory columns)."""
    return _trajectory(_read(path), path)


def _trajectory(raw, path) -> dict | None:
    from lab.study import trajectory
    if not isinstance(raw, dict) or "trajectory" not in raw:
        return None
    try:
        return trajectory.validate(raw["trajectory"], str(path))
    except trajectory.TrajectoryError as e:
        raise ClaimsError(str(e)) from None


def load_sequential(path) -> dict:
    """{family: {looks, spending}}: the group-sequential plans declared for families whose seeds may grow after a
    look (the `sequential:` block; {} without one; lab/study/sequential.py)."""
    raw = _read(path)
    return validate_sequential(raw.get("sequential"), str(path)) if isinstance(raw, dict) else {}


def validate_sequential(raw, where: str) -> dict:
    """Each family's plan: increasing seed counts >= 2 as `looks`, a known `spending` (default O'Brien–Fleming)."""
    from lab.study.sequential import SPENDING
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClaimsError(f"{where}: `sequential` must map families to their plans {{looks, spending}}")
    for family, plan in raw.items():
        at = f"{where}: sequential.{family}"
        if not isinstance(plan, dict) or set(plan) - {"looks", "spending", "reason"}:
            raise ClaimsError(f"{at}: expected {{looks: [n1, n2, ...], spending: {' | '.join(SPENDING)}, reason}}")
        looks = plan.get("looks")
        if (not isinstance(looks, list) or not looks or any(isinstance(n, bool) or not isinstance(n, int) or n < 2
                                                            for n in looks) or looks != sorted(set(looks))):
            raise ClaimsError(f"{at}.looks: expected increasing seed counts >= 2, found {looks!r}")
        if plan.get("spending", "obrien-fleming") not in SPENDING:
            raise ClaimsError(f"{at}.spending: expected one of {', '.join(SPENDING)}, found {plan['spending']!r}")
    return raw


def validate_declared(raw, where: str) -> dict:
    """Each family's metrics with a positive margin (and effect, default the margin) and a reason."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClaimsError(f"{where}: `declared` must map families to their metrics")
    for family, metrics in raw.items():
        if not isinstance(metrics, dict):
            raise ClaimsError(f"{where}: declared.{family}: expected a mapping of metrics ({', '.join(METRICS)})")
        for metric, d in metrics.items():
            at = f"{where}: declared.{family}.{metric}"
            _check_choice(metric, METRICS, f"{where}: declared.{family}")
            _check_keys(d, {"margin", "reason"}, {"effect"}, at)
            for key in ("margin", "effect"):
                v = d.get(key, d["margin"])
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise ClaimsError(f"{at}.{key}: expected a positive number (top1 as a fraction), got {v!r}")
            if not isinstance(d["reason"], str) or not d["reason"].strip():
                raise ClaimsError(f"{at}.reason: say why this margin (a string)")
    return raw


def validate_claims(raw, where: str = "claims", reads: str = "summary") -> list[dict]:
    """Check the list of claims up front, so a typo fails with its claim id instead of as 'not resolved'."""
    if not isinstance(raw, list) or not raw:
        raise ClaimsError(f"{where}: expected a non-empty list of claims")
    seen: set = set()
    for i, claim in enumerate(raw):
        cid = _validate_claim(claim, i, where, reads, seen)
        if cid in seen:
            raise ClaimsError(f"{where}: claim id {cid!r} appears twice")
        seen.add(cid)
    return raw


def _validate_claim(claim, i: int, where: str, reads: str, above: set) -> str:
    if not isinstance(claim, dict):
        raise ClaimsError(f"{where}: claim #{i + 1} is not a mapping")
    cid = claim.get("id")
    if not isinstance(cid, str) or not cid:
        raise ClaimsError(f"{where}: claim #{i + 1} needs an `id` (a string)")
    for key in ("text", "source"):
        if not isinstance(claim.get(key), str) or not claim[key].strip():
            raise ClaimsError(f"claim {cid}: needs `{key}` (a string)")
    if "requires" in claim and claim["requires"] not in above:
        raise ClaimsError(f"claim {cid}: requires {claim['requires']!r}, which is not a claim above it")
    reads = claim.get("reads", reads)
    _check_choice(reads, TABLES, f"claim {cid}: reads")
    allowed = kinds(reads)
    predicates = [k for k in claim if k not in CLAIM_KEYS]
    if len(predicates) != 1:
        raise ClaimsError(f"claim {cid}: needs exactly one predicate, got {', '.join(map(str, predicates)) or 'none'}"
                          f"; allowed: {', '.join(_names(reads))} (besides {', '.join(CLAIM_KEYS)})")
    _validate_predicate(predicates[0], claim[predicates[0]], cid, reads, allowed)
    return cid


def _names(reads: str) -> list[str]:
    return [*kinds(reads), *(["all"] if "all" not in kinds(reads) else [])]


def _validate_predicate(kind, body, cid: str, reads: str, allowed: dict) -> None:
    """One predicate (recursively for `all`): a kind registered on the table, known keys, allowed values."""
    if kind != "all" and kind not in allowed:
        raise ClaimsError(f"claim {cid}: unknown predicate kind {kind!r}; allowed: {', '.join(_names(reads))} "
                          f"(the {reads} table's kinds)")
    if kind == "all":
        if not isinstance(body, list) or not body:
            raise ClaimsError(f"claim {cid}: `all` needs a non-empty list of predicates")
        for item in body:
            if not isinstance(item, dict) or len(item) != 1:
                raise ClaimsError(f"claim {cid}: each item of `all` is one predicate, e.g. `- cost: {{...}}`; "
                                  f"allowed kinds: {', '.join(_names(reads))}")
            _validate_predicate(*next(iter(item.items())), cid, reads, allowed)
        return
    _check_keys(body, set(allowed[kind].required), set(allowed[kind].optional), f"claim {cid}: {kind}")
    if reads == "summary":
        _validate_summary(kind, body, cid)
    elif kind in ("bound", "each_run"):  # the runs table's: one limit, a number
        _one_limit(kind, body, cid)


def _one_limit(kind: str, body: dict, cid: str) -> None:
    """A bound's limit (summary: bound, share; runs: bound, each_run): exactly one of at_least, at_most, a number."""
    limits = [k for k in ("at_least", "at_most") if k in body]
    if len(limits) != 1:
        raise ClaimsError(f"claim {cid}: {kind} needs exactly one of at_least, at_most")
    if isinstance(body[limits[0]], bool) or not isinstance(body[limits[0]], (int, float)):
        raise ClaimsError(f"claim {cid}: {kind}.{limits[0]} must be a number (top1 as a fraction: -0.003)")


def _validate_summary(kind: str, body: dict, cid: str) -> None:
    """The values of a summary kind's keys: metric, rows, limits, columns, directions, positive numbers."""
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
    if kind in ("bound", "share"):
        _one_limit(kind, body, cid)
    if kind == "share":
        _check_choice(body["column"], SHARE_COLUMNS, f"claim {cid}: share.column")
    if kind == "compare":
        _check_choice(body["is"], DIRECTIONS, f"claim {cid}: compare.is")
    if kind == "more_overflow":
        _check_choice(body.get("column", COUNT_COLUMNS[0]), COUNT_COLUMNS, f"claim {cid}: more_overflow.column")
    for key in ("at_least_per_1k", "ratio", "low", "high"):
        if key in body and (isinstance(body[key], bool) or not isinstance(body[key], (int, float)) or body[key] <= 0):
            raise ClaimsError(f"claim {cid}: {kind}.{key} must be a positive number; found {body[key]!r}")
    if kind == "scale_range" and body["low"] > body["high"]:
        raise ClaimsError(f"claim {cid}: scale_range.low must be <= high; found {body['low']} > {body['high']}")


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
        table = runfiles.read_csv_frame(path)  # lab.core.runfiles: a cut or damaged table named by line
    except runfiles.RunFileError as e:
        raise ClaimsError(str(e)) from None
    missing = [c for c in ROW_KEYS if c not in table]
    if missing:
        raise ClaimsError(f"{path}: no {', '.join(missing)} column: not a summary table")
    return table

"""The alert-threshold study's tables (lab/diagnose/alerts.py reads the runs and their outcomes; docs/alerts.md):
every detector's precision and recall against "ends worse than FP32", with intervals, per study, and the thresholds
the data support, written as csv and md (`python -m lab alert-thresholds ... --out DIR`).

Intervals, two per rate: Wilson's 95% interval over the runs (as if independent), and the cluster interval: runs of
one study's seed share their FP32 reference, initial weights and data order, so each cluster is one unit, its runs
collapsed the conservative way for each end (lab/study/claims/detection.py, the claims' own count): the exact
(Clopper-Pearson) 95% lower end from the clusters whose every relevant run hits, the upper end from those where any
does. Where every cluster holds one relevant run the two counts coincide.

The thresholds the data support: the clusters of each study split in two by their order (alternately, so that both
halves hold every study), each detector family's threshold chosen on the first half by F1 (the harmonic mean of
precision and recall; ties: the threshold that fires on fewer runs), then judged on the second; a family whose
threshold fires on no run that ends worse in the first half cannot be chosen, and the table says so.
"""
from __future__ import annotations

import math
from itertools import product
from pathlib import Path

import pandas as pd
from scipy import stats as st

from lab.core import files
from lab.study.claims.detection import describe, fires, units

STREAKS = tuple(range(1, 16))
RATIOS = (0.90, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)
#: detector family -> (column, how it fires, thresholds)
FAMILIES = {"longest skip streak": ("longest_skip_streak", "at_least", STREAKS),
            "longest skip streak after the first clean step": ("longest_streak_in_training", "at_least", STREAKS),
            "update ratio": ("update_ratio", "at_most", RATIOS)}
#: the source's own thresholds: 3 and 10 consecutive skips, 95% update ratio
SOURCE = {("longest_skip_streak", 3), ("longest_skip_streak", 10), ("update_ratio", 0.95)}
#: the runs a rate is counted over: every judged run; the studies' alone (the catalogue's planted failures are built to
#: fail, and fail loudly); only those under a loss scale that skips (FP16 with a policy), where a skip can happen
SCOPES = {"every judged run": None, "the studies' runs": "study", "loss-scaled FP16 runs": "loss_scaled"}
CATALOGUE = "catalogue"


def _judged(runs: pd.DataFrame, column: str, among: str | None) -> pd.DataFrame:
    """The runs with an outcome (and, for ``among``, its rows with 1; "study": the studies' runs) whose detector
    input is known."""
    j = runs[pd.to_numeric(runs["worse"], errors="coerce").isin([0, 1]) & runs[column].notna()]
    if among == "study":
        return j[j["study"] != CATALOGUE]
    return j[pd.to_numeric(j[among], errors="coerce") == 1] if among else j


def _wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    ci = st.binomtest(k, n).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


def _cluster_interval(judged: pd.DataFrame, spec: dict, measure: str) -> tuple[float, float, int]:
    """(low, high, clusters): the exact 95% ends from the strict and the lenient cluster counts."""
    n, k_all, k_any, _, _ = units(judged, spec, measure)
    if n == 0:
        return math.nan, math.nan, 0
    return (float(st.binomtest(k_all, n).proportion_ci(0.95, "exact").low),
            float(st.binomtest(k_any, n).proportion_ci(0.95, "exact").high), n)


def rates(judged: pd.DataFrame, column: str, how: str, threshold: float) -> dict:
    """One detector's counts and rates over ``judged`` (runs with an outcome and a known input)."""
    spec = {"column": column, "fires": {how: threshold}}
    fired = fires(judged[column], spec["fires"])
    worse = pd.to_numeric(judged["worse"]) == 1
    tp, fp, fn = int((fired & worse).sum()), int((fired & ~worse).sum()), int((~fired & worse).sum())
    row = {"detector": describe(column, spec["fires"]), "column": column, "threshold": threshold,
           "source": (column, threshold) in SOURCE, "runs": len(judged), "worse": int(worse.sum()),
           "fired": tp + fp, "tp": tp, "fp": fp, "fn": fn, "tn": len(judged) - tp - fp - fn}
    for measure, k, n in (("precision", tp, tp + fp), ("recall", tp, tp + fn)):
        row[measure] = k / n if n else math.nan
        row[f"{measure}_wilson_low"], row[f"{measure}_wilson_high"] = _wilson(k, n)
        low, high, clusters = _cluster_interval(judged, spec, measure)
        row[f"{measure}_cluster_low"], row[f"{measure}_cluster_high"], row[f"{measure}_clusters"] = low, high, clusters
    return row


def detector_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Every detector of every family, in each scope."""
    rows = []
    for scope, among in SCOPES.items():
        for family, (column, how, grid) in FAMILIES.items():
            judged = _judged(runs, column, among)
            rows += [{"scope": scope, "family": family, **rates(judged, column, how, t)} for t in grid]
    return pd.DataFrame(rows)


def study_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per study: runs read, their outcomes, and the source's thresholds' firings (on runs that end worse / all)."""
    rows = []
    for study, g in runs.groupby("study", sort=True):
        row = {"study": study, "runs": len(g), "judged": int(g["worse"].notna().sum()),
               "worse": int((g["worse"] == 1).sum()),
               **{o: int((g["outcome"] == o).sum()) for o in ("reference", "no FP32 twin", "diverged")},
               "loss_scaled": int(g["loss_scaled"].sum()), "longest_streak_max": g["longest_skip_streak"].max(),
               "update_ratio_min": g["update_ratio"].min()}
        for column, threshold in sorted(SOURCE):
            how = "at_most" if column == "update_ratio" else "at_least"
            judged = _judged(g, column, None)
            r = rates(judged, column, how, threshold)
            row[f"{r['detector']}: fired (worse)"] = f"{r['fired']} ({r['tp']})"
        rows.append(row)
    return pd.DataFrame(rows)


def halves(runs: pd.DataFrame) -> pd.Series:
    """'fit' or 'judge' for each run: each study's clusters, in order, alternately."""
    side = {}
    for _, g in runs.groupby("study", sort=True):
        for i, cluster in enumerate(sorted(g["cluster"].unique())):
            side[cluster] = "fit" if i % 2 == 0 else "judge"
    return runs["cluster"].map(side)


def choose(runs: pd.DataFrame) -> pd.DataFrame:
    """Each family's threshold chosen by F1 on the fitting half and judged on the other, beside the source's: over
    every judged run, and over the studies' alone."""
    side, rows = halves(runs), []
    for (scope, among), (family, (column, how, grid)) in product(list(SCOPES.items())[:2], FAMILIES.items()):
        fit, judge = (_judged(runs[side == h], column, among) for h in ("fit", "judge"))
        scored = [rates(fit, column, how, t) for t in grid]
        best = max(scored, key=lambda r: (2 * r["tp"] / max(2 * r["tp"] + r["fp"] + r["fn"], 1), -r["fired"]))
        row = {"scope": scope, "family": family, "fit_runs": len(fit), "fit_worse": int(fit["worse"].sum()),
               "judge_runs": len(judge), "judge_worse": int(judge["worse"].sum()),
               "judge_base_rate": judge["worse"].mean() if len(judge) else math.nan}
        if best["tp"] == 0:
            row.update(chosen="cannot choose", why="no threshold fires on a run that ends worse in the fitting half")
        else:
            row.update(chosen=best["detector"], threshold=best["threshold"],
                       fit_f1=2 * best["tp"] / (2 * best["tp"] + best["fp"] + best["fn"]),
                       **{f"judge_{k}": v for k, v in _judged_rates(judge, column, how, best["threshold"]).items()})
        source = [t for c, t in SOURCE if c == column]
        for t in sorted(source):
            row.update({f"source_{t:g}_{k}": v for k, v in _judged_rates(judge, column, how, t).items()})
        rows.append(row)
    return pd.DataFrame(rows)


def _judged_rates(judged: pd.DataFrame, column: str, how: str, threshold: float) -> dict:
    r = rates(judged, column, how, threshold)
    return {"precision": _frac(r["tp"], r["fired"], r["precision_wilson_low"], r["precision_wilson_high"]),
            "recall": _frac(r["tp"], r["worse"], r["recall_wilson_low"], r["recall_wilson_high"])}


def _frac(k: int, n: int, low: float, high: float) -> str:
    return f"{k}/{n}" + (f" ({k / n:.0%}, {low:.0%}-{high:.0%})" if n else "")


def write(runs: pd.DataFrame, out) -> list[Path]:
    """runs.csv (what the claims read), detectors.csv, studies.csv, choice.csv and alerts.md under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = {"runs": runs, "detectors": detector_table(runs), "studies": study_table(runs), "choice": choose(runs)}
    written = []
    for name, table in tables.items():
        files.atomic_write_text(out / f"{name}.csv", table.to_csv(index=False, float_format="%.6g"))
        written.append(out / f"{name}.csv")
    files.atomic_write_text(out / "alerts.md", markdown(tables))
    return written + [out / "alerts.md"]


# --- the markdown ---------------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x:.0%}"


def _rate(r: dict, measure: str) -> str:
    """'3/5 (60%; Wilson 23-88%; clusters 15-95%, 4)' for one rate of a detector row."""
    k, n = r["tp"], r["fired"] if measure == "precision" else r["worse"]
    if not n:
        return "— (0 runs)"
    return (f"{k}/{n} ({_pct(r[measure])}; Wilson {_pct(r[f'{measure}_wilson_low'])}-"
            f"{_pct(r[f'{measure}_wilson_high'])}; {r[f'{measure}_clusters']} clusters "
            f"{_pct(r[f'{measure}_cluster_low'])}-{_pct(r[f'{measure}_cluster_high'])})")


def _md(table: pd.DataFrame) -> str:
    cols = list(table.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table.itertuples(index=False):
        lines.append("| " + " | ".join("—" if isinstance(v, float) and not math.isfinite(v) else
                                       f"{v:.4g}" if isinstance(v, float) else str(v) for v in r) + " |")
    return "\n".join(lines)


def _same_runs(rows: list[dict]) -> list[list[dict]]:
    """Consecutive thresholds of one family that fire on the same runs (their counts equal), grouped."""
    groups: list[list[dict]] = []
    for r in rows:
        key = (r["family"], r["fired"], r["tp"], r["runs"])
        if groups and (groups[-1][0]["family"], groups[-1][0]["fired"], groups[-1][0]["tp"], groups[-1][0]["runs"]) == key:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def markdown(tables: dict) -> str:
    runs, det, studies, choice = (tables[k] for k in ("runs", "detectors", "studies", "choice"))
    judged = runs[runs["worse"].notna()]
    out = ["# The source's alert thresholds as detectors", "",
           f"{len(runs)} runs read, {len(judged)} judged ({int(judged['worse'].sum())} end worse than FP32 or "
           f"diverged, or are planted failures), in {judged['cluster'].nunique()} clusters (a study's seed; a "
           "catalogue loop). Outcome: validation loss minus the FP32 run's of the same study, family and seed, "
           "against the study's declared margin (worse above it; diverged counts as worse); the catalogue's loops "
           "by construction. A detector fires when its input is in the range. Precision: of the runs it fires on, "
           "those that end worse; recall: of the runs that end worse, those it fires on. Each rate: runs, Wilson's "
           "95% interval over runs, and the exact 95% interval over clusters (the unit where runs of one seed are "
           "not independent: lab/diagnose/alert_tables.py). **Bold**: the source's thresholds. Generated by "
           "`python -m lab alert-thresholds` (docs/alerts.md).", "", "## The runs, by study", "",
           _md(studies), ""]
    for scope, g in det.groupby("scope", sort=False):
        out += [f"## Every detector: {scope}", "", "| detector | fires on (worse / all) | precision | recall |",
                "|---|---|---|---|"]
        for group in _same_runs(g.to_dict("records")):
            r, last = group[0], group[-1]
            name = r["detector"] + (f" … {last['threshold']:g} (the same runs)" if len(group) > 1 else "")
            name = f"**{name}**" if any(x["source"] for x in group) else name
            out.append(f"| {name} | {r['tp']} / {r['fired']} of {r['runs']} runs ({r['worse']} worse) | "
                       f"{_rate(r, 'precision')} | {_rate(r, 'recall')} |")
        out.append("")
    out += ["## The thresholds the data support", "",
            "Each study's clusters split alternately into a fitting and a judging half; the threshold with the best "
            "F1 on the first, judged on the second (precision and recall: runs, Wilson 95%), beside the source's "
            "on the same half.", "", _md(choice), ""]
    return "\n".join(out)

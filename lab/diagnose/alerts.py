"""The source's alert thresholds judged as detectors over the lab's recorded runs (docs/alerts.md).

The source (its guide to tuning the strategy, monitoring): "a single overflow is normal; three or more consecutive
skips: alert; ten: fall back to FP32"; "update_ratio (applied steps / all steps), ideally above 95%". Each is a
detector of a run: it fires when the run's longest streak of skipped steps reaches k, or when its update ratio is r or
less. Each run's outcome: did it end worse than FP32, the run of the same study, family and seed (its validation loss
above FP32's by more than the study's declared margin for the family: the claims file's `declared:`, else the study
config's `stats.margins`; or it diverged), or not. The diagnose catalogue's loops (lab/diagnose/catalogue.py) add
planted failures whose outcome is known by construction.

Reading (lab/core/runfiles.py, the one reader): a run directory's metrics.json and steps.csv (each step's `skipped`
and `found_inf`: the streaks are counted here, the whole run's and those after the first clean step); for a study
whose run directories are not kept, its per-run table (results/*/tables/runs.csv, `lab aggregate`'s: the scaler's own
`max_consecutive_skips` and `update_ratio`; the streak after the first clean step where the overflow counts fix it,
else unknown). A run read both ways is taken from its directory. The tables and their method: lab/diagnose/
alert_tables.py. Nothing here trains; `record-catalogue` records the catalogue's 40-step loops.
"""
from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import pandas as pd
import yaml

from lab.core import runfiles
from lab.core.errors import ConfigError

REFERENCE = "fp32"           # the mode every other run of its study, family and seed is judged against
CATALOGUE = "catalogue"      # the study name of the diagnose catalogue's recordings
KEYS = {"study", "results_dir", "device", "claims_file", "alerts"}
ALERT_KEYS = {"runs", "catalogue", "configs"}
#: the per-run table's columns (results/alerts/tables/runs.csv), what the claims engine's `detects` kind reads
COLUMNS = ["study", "model", "mode", "seed", "cluster", "read_from", "precision", "policy", "loss_scaled", "steps",
           "skipped_steps", "update_ratio", "longest_skip_streak", "longest_streak_in_training", "val_loss",
           "fp32_val_loss", "delta", "margin", "outcome", "worse"]


# --- the study's config (configs/alerts.yaml) --------------------------------------------------------------------
def is_alerts_file(path) -> bool:
    """Whether ``path`` is a YAML file that says ``study: alerts``."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and data.get("study") == "alerts"


def load_alerts(source) -> dict:
    """The study, checked: {study, results_dir, device, claims_file, runs: [patterns], catalogue: folder, configs:
    [patterns]}; ConfigError naming the key otherwise."""
    where = "the alert-threshold study" if isinstance(source, dict) else str(source)
    if isinstance(source, dict):
        data = dict(source)
    else:
        try:
            data = yaml.safe_load(Path(source).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{where}: cannot be read as YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict) or data.get("study") != "alerts":
        raise ConfigError(f"{where}: expected a mapping with study: alerts")
    unknown = sorted(set(data) - KEYS)
    block = data.get("alerts")
    if unknown or not isinstance(block, dict) or sorted(set(block) - ALERT_KEYS):
        raise ConfigError(f"{where}: expected keys {', '.join(sorted(KEYS))} and alerts: {{{', '.join(sorted(ALERT_KEYS))}}}"
                          f"; found {', '.join(unknown) or 'alerts: ' + repr(block)}")
    runs = block.get("runs")
    if not isinstance(runs, list) or not runs or not all(isinstance(p, str) and p for p in runs):
        raise ConfigError(f"{where}: alerts.runs: expected a list of run-directory or runs.csv patterns, got {runs!r}")
    if data.get("device", "cpu") != "cpu":
        raise ConfigError(f"{where}: device: the study reads recorded runs on the CPU (device: cpu)")
    return {"study": "alerts", "results_dir": str(data.get("results_dir", "results/alerts")), "device": "cpu",
            "claims_file": data.get("claims_file"), "runs": runs,
            "catalogue": block.get("catalogue"), "configs": block.get("configs", ["configs/*.yaml"])}


# --- the studies a run belongs to ---------------------------------------------------------------------------------
def study_configs(patterns) -> list[dict]:
    """[{name, results_dir, config}] of the training studies' configs matching ``patterns`` (claims files and the
    RL and alert studies, which hold no lab runs, left out), the longest results_dir first: a run belongs to the
    first whose folder holds it."""
    found = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        if Path(path).name.startswith("claims"):
            continue
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot be read as YAML ({' '.join(str(e).split())})") from None
        if not isinstance(raw, dict) or "results_dir" not in raw or raw.get("study") in ("rl", "alerts"):
            continue
        results = str(raw["results_dir"]).rstrip("/")
        found.append({"name": "default" if results == "results" else Path(results).name,
                      "results_dir": _absolute(results), "config": path})
    return sorted(found, key=lambda s: -len(s["results_dir"].parts))


def _absolute(path) -> Path:
    """The path made absolute without following links: a run folder linked into a results_dir stays in it."""
    return Path(os.path.abspath(path))


def study_of(path: Path, studies: list[dict]) -> dict:
    absolute = _absolute(path)
    for s in studies:
        if absolute.is_relative_to(s["results_dir"]):
            return s
    raise ConfigError(f"{path}: under no study's results_dir (the configs given: {len(studies)}); a run is judged "
                      "against its own study's FP32 runs and margins")


def study_settings(study: dict, cache: dict) -> dict:
    """{margins: {family: val_loss margin}, default_margin, modes: {mode: (precision, policy)}} of a study, from its
    config (lab.core.config.load_study) and its claims file's `declared:` block, read once."""
    if study["config"] not in cache:
        from lab.core.config import load_study
        from lab.study.claims.file import load_declared
        cfg = load_study([study["config"]])
        claims_file = cfg.get("claims_file") or ("configs/claims.yaml" if study["name"] == "default" else None)
        declared = load_declared(claims_file) if claims_file and Path(claims_file).is_file() else {}
        modes = {m: (v.get("precision"), (v.get("scaler") or {}).get("policy")) for m, v in cfg["modes"].items()}
        cache[study["config"]] = {
            "margins": {f: d["val_loss"]["margin"] for f, d in declared.items() if "val_loss" in d},
            "default_margin": float(cfg["stats"]["margins"]["val_loss"]), "modes": modes}
    return cache[study["config"]]


# --- one run's detectors ------------------------------------------------------------------------------------------
def skip_streaks(skipped: list[bool], found_inf: list[bool]) -> dict:
    """The detectors' inputs from a run's steps: the longest streak of skipped steps, the longest one after the first
    clean step (a step without inf/NaN: the end of the descent from the initial scale; none: 0), the skipped steps
    and the update ratio (applied steps over all steps; 1 for a run of no steps)."""
    from lab.diagnose.record import _streaks  # diagnose's own streaks (its longest_skip_streak)
    first_clean = next((i for i, f in enumerate(found_inf) if not f), len(found_inf))

    def longest(flags):
        return max((length for _, length in _streaks(list(flags))), default=0)
    n, k = len(skipped), sum(skipped)
    return {"steps": n, "skipped_steps": k, "update_ratio": (n - k) / n if n else 1.0,
            "longest_skip_streak": longest(skipped), "longest_streak_in_training": longest(skipped[first_clean:])}


def in_training_from_counts(longest: float, skipped: float, initial: float, in_training: float) -> float:
    """The longest streak after the first clean step from a per-run table's counts, where they fix it: none skipped
    (0), a longest streak longer than the initial descent (it came after), at most one overflow in training (that
    many); else NaN (unknown)."""
    if skipped == 0:
        return 0.0
    if longest > initial:
        return float(longest)
    return float(in_training) if in_training <= 1 else math.nan


def read_run(run_dir: Path) -> dict:
    """A run directory's identity, status and detectors' inputs (metrics.json, steps.csv)."""
    metrics = runfiles.read_json(run_dir / "metrics.json")
    steps = run_dir / "steps.csv"
    if not steps.is_file():
        raise runfiles.RunFileError(f"{steps}: missing (a finished run writes it beside metrics.json)")
    _, rows = runfiles.read_csv(steps, runfiles.STEP_COLUMNS, live=runfiles.is_live(steps))
    skipped = [runfiles.number(steps, r, "skipped", bool) for r in rows]
    found = [runfiles.number(steps, r, "found_inf", bool) for r in rows]
    for key in ("model", "mode", "seed"):
        if key not in metrics:
            raise runfiles.RunFileError(f"{run_dir / 'metrics.json'}: no {key!r} (not a lab run or recording)")
    diverged = metrics.get("status") == "diverged" or bool(metrics.get("diverged"))
    loss = metrics.get("final_val_loss")
    return {"model": str(metrics["model"]), "mode": str(metrics["mode"]), "seed": int(metrics["seed"]),
            "read_from": str(run_dir), "precision": metrics.get("precision"), "policy": metrics.get("scaler"),
            "recording": bool(metrics.get("recording")), "status": metrics.get("status", "ok"), "diverged": diverged,
            "val_loss": float(loss) if isinstance(loss, (int, float)) and not diverged else math.nan,
            **skip_streaks(skipped, found)}


def read_table(path: Path, modes: dict) -> list[dict]:
    """A study's per-run table (lab aggregate's runs.csv), each row as read_run gives a run (``modes``: the study's
    {mode: (precision, policy)})."""
    need = ("model", "mode", "seed", "val_loss", "diverged", "steps", "skipped_steps", "update_ratio",
            "max_consecutive_skips")
    t = runfiles.read_csv_frame(path, need)
    out = []
    for r in t.to_dict("records"):
        precision, policy = modes.get(r["mode"], (None, None))
        initial, in_training = (r.get(c, math.nan) for c in ("overflow_initial", "overflow_in_training"))
        out.append({"model": str(r["model"]), "mode": str(r["mode"]), "seed": int(r["seed"]), "read_from": str(path),
                    "precision": precision or r.get("recipe"), "policy": policy, "recording": False,
                    "status": "diverged" if r["diverged"] else "ok", "diverged": bool(r["diverged"]),
                    "val_loss": float(r["val_loss"]) if not r["diverged"] else math.nan, "steps": int(r["steps"]),
                    "skipped_steps": int(r["skipped_steps"]), "update_ratio": float(r["update_ratio"]),
                    "longest_skip_streak": int(r["max_consecutive_skips"]),
                    "longest_streak_in_training": in_training_from_counts(
                        r["max_consecutive_skips"], r["skipped_steps"], initial, in_training)})
    return out


# --- every run, then its outcome ----------------------------------------------------------------------------------
def collect(patterns, config_patterns=("configs/*.yaml",)) -> pd.DataFrame:
    """Every run the patterns match (run directories, or per-run tables named runs.csv), one row each, with its
    study; a pattern that matches nothing, or a match that is neither, is a ConfigError naming it."""
    studies, cache, rows = None, {}, []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"{pattern}: matches no run directory (a folder with metrics.json) or runs.csv")
        for match in map(Path, matches):
            if match.is_dir() and (match / "metrics.json").is_file():
                row = read_run(match)
                if row["recording"] and _scenario(row["model"]) is not None:
                    rows.append({**row, "study": CATALOGUE})
                    continue
            elif not (match.is_file() and match.name == "runs.csv"):
                raise ConfigError(f"{match}: neither a finished run directory (no metrics.json) nor a per-run table "
                                  "(runs.csv)")
            studies = study_configs(config_patterns) if studies is None else studies
            study = study_of(match, studies)
            settings = study_settings(study, cache)
            if match.is_dir():
                rows.append({**row, "study": study["name"], "_settings": settings})
            else:
                rows += [{**r, "study": study["name"], "_settings": settings} for r in read_table(match,
                                                                                                   settings["modes"])]
    return label(_unique(rows))


def _scenario(name: str):
    from lab.diagnose.catalogue import scenario  # torch, only when a recording is among the runs
    return scenario(name)


def _unique(rows: list[dict]) -> list[dict]:
    """One row per (study, model, mode, seed): a run directory over a table's row of the same run."""
    best: dict = {}
    for r in rows:
        key = (r["study"], r["model"], r["mode"], r["seed"])
        if key not in best or (best[key]["read_from"].endswith("runs.csv") and not r["read_from"].endswith("runs.csv")):
            best[key] = r
    return list(best.values())


def label(rows: list[dict]) -> pd.DataFrame:
    """The per-run table: each run's outcome against the FP32 run of its study, family and seed (worse: 1 when its
    validation loss is above FP32's by more than the margin, or it diverged; 0 when not; empty for the FP32 runs and
    the runs without an FP32 twin), a catalogue loop's planted outcome, and its cluster (study/seed)."""
    refs = {(r["study"], r["model"], r["seed"]): r for r in rows if r["mode"] == REFERENCE}
    out = []
    for r in rows:
        settings = r.pop("_settings", None)
        row = {**r, "cluster": f"{r['study']}/seed{r['seed']}", "fp32_val_loss": math.nan, "delta": math.nan,
               "margin": math.nan}
        if r["study"] == CATALOGUE:
            planted = _scenario(r["model"]).ends_worse
            row.update(cluster=f"{CATALOGUE}/{r['model']}", outcome="planted failure" if planted else "planted healthy",
                       worse=int(planted))
        elif r["mode"] == REFERENCE:
            row.update(outcome="reference", worse=math.nan)
        elif r["status"] == "failed":  # it raised: a crash to fix, not a result (as the study's tables leave it out)
            row.update(outcome="failed", worse=math.nan)
        elif (ref := refs.get((r["study"], r["model"], r["seed"]))) is None or ref["diverged"]:
            row.update(outcome="no FP32 twin" if ref is None else "FP32 twin diverged", worse=math.nan)
        else:
            margin = settings["margins"].get(r["model"], settings["default_margin"])
            delta = r["val_loss"] - ref["val_loss"]
            outcome = ("diverged" if r["diverged"] else "worse" if delta > margin else "better" if delta < -margin
                       else "equivalent")
            row.update(fp32_val_loss=ref["val_loss"], delta=delta, margin=margin, outcome=outcome,
                       worse=int(outcome in ("worse", "diverged")))
        row["loss_scaled"] = int(row.get("precision") == "fp16" and row.get("policy") not in (None, "none"))
        out.append(row)
    table = pd.DataFrame(out, columns=COLUMNS) if out else pd.DataFrame(columns=COLUMNS)
    return table.sort_values(["study", "model", "mode", "seed"], kind="stable").reset_index(drop=True)

"""Load a study's results: figures, the report, TensorBoard export and notebooks all read them through here.

A *source* is any of: a results folder (holding `runs/`), a `runs/` folder (or any folder below it), one
run directory (`runs/<model>/<mode>/seed<n>/`), or a list of those. Every loader returns a pandas DataFrame with
the run's identity columns `model`, `mode`, `seed` (and `run_dir`) first; a file a run does not have (a census
from before the census existed, a run still training) is skipped, never an error, and a loader with nothing to
load returns an empty frame with the documented columns.

Also here: the file layout of the outputs (figure and TensorBoard paths, which the workflow needs at DAG
time) and the order models and modes are shown in. The computations figures and notebooks share on the loaded
frames (FP16 limits, fraction of values lost at a loss scale, per-layer underflow, ...) are in lab.report.derived.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import yaml

from lab.core import runfiles

ID_COLUMNS = ["model", "mode", "seed"]
STEP_COLUMNS = ["step", "epoch", "loss", "scale", "found_inf", "skipped", "grad_norm", "lr", "precision"]
CENSUS_COLUMNS = ["step", "scale", "source", "layer", "at_scale", "total", "zero", "underflow", "subnormal",
                  "normal", "overflow"]
HIST_COLUMNS = ["step", "source", "at_scale", "log2_bin", "count"]

# Output layout. The workflow (workflow/rules/report.smk) names these files before anything runs.
MODEL_FIGURES = {  # file stem -> what it shows
    "scale": "loss scale over steps, every mode",
    "loss": "training loss over steps, every mode",
    "grad_hist": "log2 gradient magnitudes of an FP32 run against FP16's range",
    "top1": "validation top-1 per mode over seeds",
    "underflow": "per-layer underflow fraction, layers x modes",
    "overflow": "where overflow steps start: first non-finite gradient, per mode",
}
MODE_FIGURE_DIR = "modes"  # figures/<model>/modes/<mode>.png: one mode's runs, seed by seed


def figure_path(out: str | Path, model: str, name: str) -> Path:
    return Path(out) / model / f"{name}.png"


def mode_figure_path(out: str | Path, model: str, mode: str) -> Path:
    return Path(out) / model / MODE_FIGURE_DIR / f"{mode}.png"


def tensorboard_dir(out: str | Path, model: str, mode: str, seed: int) -> Path:
    return Path(out) / model / mode / f"seed{seed}"


# --- finding runs -------------------------------------------------------------------------------------------
def _is_run_dir(p: Path) -> bool:
    return (p / "metrics.json").is_file() or (p / "steps.csv").is_file() or (p / "config.yaml").is_file()


def run_dirs(source, model: str | None = None, mode: str | None = None, complete: bool = False) -> list[Path]:
    """Run directories under `source` (see the module docstring; any folder holding run directories will
    do), optionally one model's / one mode's.

    complete=True keeps only finished runs (metrics.json is written last, so its presence means finished).
    """
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    found: list[Path] = []
    for s in sources:
        p = Path(s)
        if _is_run_dir(p):
            found.append(p)
            continue
        base = p / "runs" if (p / "runs").is_dir() else p  # a results folder, runs/, or runs/<model>[/<mode>]
        # not below a hidden folder: a run's .finished/ copy (lab/run/finished.py) is no run of its own
        found.extend(sorted({f.parent for name in ("metrics.json", "steps.csv") for f in base.rglob(name)
                             if not any(part.startswith(".") for part in f.relative_to(base).parts[:-1])}))
    out, seen = [], set()
    for d in found:
        key = d.resolve()
        if key in seen:
            continue
        seen.add(key)
        ident = run_identity(d)
        if model is not None and ident["model"] != model:
            continue
        if mode is not None and ident["mode"] != mode:
            continue
        if complete and not (d / "metrics.json").is_file():
            continue
        out.append(d)
    return out


def run_identity(run_dir: str | Path) -> dict:
    """model, mode, seed and precision of a run: from metrics.json, else config.yaml, else the path."""
    d = Path(run_dir)
    if (d / "metrics.json").is_file():
        m = runfiles.read_json(d / "metrics.json")
        try:
            return {"model": m["model"], "mode": m["mode"], "seed": int(m["seed"]), "precision": m.get("precision")}
        except (KeyError, TypeError, ValueError):
            found = ", ".join(f"{k}={m.get(k)!r}" for k in ("model", "mode", "seed"))
            raise runfiles.RunFileError(f"{d / 'metrics.json'}: expected model, mode and seed (an integer); "
                                        f"found {found}") from None
    if (d / "config.yaml").is_file():
        c = runfiles.read_yaml(d / "config.yaml")
        try:
            return {"model": c["model"]["family"], "mode": c["mode"]["name"], "seed": int(c["seed"]),
                    "precision": c["mode"].get("precision")}
        except (KeyError, TypeError):
            pass
    seed = d.name[4:] if d.name.startswith("seed") else d.name
    return {"model": d.parent.parent.name, "mode": d.parent.name, "seed": int(seed) if seed.isdigit() else -1,
            "precision": None}


# --- ordering and colours shared by every figure -----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _default_order(key: str) -> tuple[str, ...]:
    try:
        from lab.core.config import DEFAULT_CONFIG
        return tuple((yaml.safe_load(Path(DEFAULT_CONFIG).read_text()) or {}).get(key, {}))
    except Exception:  # pragma: no cover - a missing default config only loses the nice order
        return ()


def model_order(models: Iterable[str]) -> list[str]:
    """The default study's order, then any other model alphabetically."""
    ref = {m: i for i, m in enumerate(_default_order("models"))}
    return sorted(dict.fromkeys(models), key=lambda m: (ref.get(m, len(ref)), m))


def mode_order(modes: Iterable[str]) -> list[str]:
    """fp32 first, then the default study's order, then any other mode alphabetically."""
    modes = list(dict.fromkeys(modes))
    ref = _default_order("modes")
    rank = {m: i for i, m in enumerate(ref)}
    return sorted(modes, key=lambda m: (m != "fp32", rank.get(m, len(ref)), m))


def _tidy(df: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    if df.empty:
        return df
    order = mode_order(df["mode"].unique())
    models = model_order(df["model"].unique())
    df = df.assign(_mode_rank=df["mode"].map({m: i for i, m in enumerate(order)}),
                   _model_rank=df["model"].map({m: i for i, m in enumerate(models)}))
    sort = ["_model_rank", "_mode_rank", "seed"] + [c for c in ("step",) if c in df]
    df = df.sort_values(sort, kind="stable").drop(columns=["_mode_rank", "_model_rank"]).reset_index(drop=True)
    return df[first + [c for c in df.columns if c not in first]]


def _with_identity(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    if not frames:
        return pd.DataFrame(columns=ID_COLUMNS + ["precision", "run_dir"] + columns)
    return _tidy(pd.concat(frames, ignore_index=True), ID_COLUMNS)


def _read_run_csv(run_dir: Path, name: str) -> pd.DataFrame | None:
    path = run_dir / name
    if not path.is_file():
        return None
    # RunFileError naming the file when damaged (an empty file included); a live run's cut last line left out
    df = runfiles.read_csv_frame(path, live=runfiles.is_live(path))
    if df.empty:  # header only: nothing to tag
        return df
    ident = run_identity(run_dir)
    for key in ("model", "mode", "seed", "precision"):
        if key != "precision" or key not in df:  # steps.csv has its own per-step precision (FP32 fallback)
            df[key] = ident[key]
    if name in ("census.csv", "grad_hist.csv") and "grads" not in df:  # from before the FP32 replay: the
        df["grads"] = df["precision"]                                   # run's own values only
    df["run_dir"] = str(run_dir)
    return df


def _run_csvs(source, model: str | None, mode: str | None, name: str) -> list[pd.DataFrame]:
    """The non-empty `name` tables of the selected runs, each tagged with its run's identity."""
    frames = [_read_run_csv(d, name) for d in run_dirs(source, model, mode)]
    return [df for df in frames if df is not None and not df.empty]


# --- loaders ------------------------------------------------------------------------------------------------
def load_metrics(source, model: str | None = None, mode: str | None = None) -> pd.DataFrame:
    """One row per finished run: every field of its metrics.json, plus run_dir."""
    rows = []
    for d in run_dirs(source, model, mode, complete=True):
        m = runfiles.read_json(d / "metrics.json")
        m["run_dir"] = str(d)
        rows.append(m)
    if not rows:
        return pd.DataFrame(columns=ID_COLUMNS + ["precision", "final_top1", "status", "run_dir"])
    return _tidy(pd.DataFrame(rows), ID_COLUMNS)


def load_steps(source, model: str | None = None, mode: str | None = None) -> pd.DataFrame:
    """One row per optimizer step of every run (steps.csv), in long form with model/mode/seed.

    Adds per-run running counters: skip_count (skipped steps so far, this one included) and update_ratio
    (applied steps / steps so far).
    """
    frames = _run_csvs(source, model, mode, "steps.csv")
    for df in frames:
        for col in ("loss", "scale", "grad_norm", "lr"):
            if col in df:
                df[col] = pd.to_numeric(df[col], errors="coerce")
        skipped = df["skipped"].astype(int)
        df["skip_count"] = skipped.cumsum()
        df["update_ratio"] = (1 - skipped).cumsum() / np.arange(1, len(df) + 1)
    return _with_identity(frames, STEP_COLUMNS + ["skip_count", "update_ratio"])


def load_census(source, model: str | None = None, mode: str | None = None) -> pd.DataFrame:
    """Every run's census.csv (value classes of gradients per layer, see docs/census.md); empty when none has one.

    Adds underflow_frac = underflow / total and lost_frac = (underflow + overflow) / non-zero values.
    """
    frames = _run_csvs(source, model, mode, "census.csv")
    df = _with_identity(frames, CENSUS_COLUMNS + ["underflow_frac", "lost_frac"])
    if len(df):
        for col in ("total", "zero", "underflow", "subnormal", "normal", "overflow"):
            df[col] = pd.to_numeric(df[col], errors="coerce").fillna(0)
        df["at_scale"] = pd.to_numeric(df["at_scale"], errors="coerce")
        df["underflow_frac"] = df["underflow"] / df["total"].where(df["total"] > 0)
        df["lost_frac"] = (df["underflow"] + df["overflow"]) / (df["total"] - df["zero"]).where(
            df["total"] > df["zero"])
    return df


def load_hist(source, model: str | None = None, mode: str | None = None) -> pd.DataFrame:
    """Every run's grad_hist.csv: counts of |gradient| per log2 bin; empty when no run has one.

    log2_bin k means |x| in [2^k, 2^(k+1)) at the row's at_scale; the special bins "zero" and "nonfinite"
    are kept. Adds `kind` (value | zero | nonfinite), `k` (the bin as a number, NaN for the special ones) and
    `k_unscaled` = k - log2(at_scale): the bin of the unscaled gradient.
    """
    frames = _run_csvs(source, model, mode, "grad_hist.csv")
    df = _with_identity(frames, HIST_COLUMNS + ["kind", "k", "k_unscaled"])
    if len(df):
        label = df["log2_bin"].astype(str).str.strip().str.lower()
        k = pd.to_numeric(label, errors="coerce")
        finite = np.isfinite(k)
        df["k"] = k.where(finite)
        df["kind"] = np.where(finite, "value", np.where(label == "zero", "zero", "nonfinite"))
        df["at_scale"] = pd.to_numeric(df["at_scale"], errors="coerce").fillna(1.0)
        df["count"] = pd.to_numeric(df["count"], errors="coerce").fillna(0)
        df["k_unscaled"] = df["k"] - np.log2(df["at_scale"])
    return df


def load_summary(results_dir, recompute: bool = False) -> pd.DataFrame:
    """The study's summary table (results/tables/summary.csv), or computed from the runs when it is absent."""
    path = Path(results_dir) / "tables" / "summary.csv"
    if path.is_file() and not recompute:
        return runfiles.read_csv_frame(path)  # RunFileError naming the file when damaged
    metrics = load_metrics(results_dir)
    if metrics.empty:
        from lab.study.aggregate import SUMMARY_COLUMNS
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    from lab.study.aggregate import summarize
    if "device_name" not in metrics:
        metrics["device_name"] = metrics.get("device", "unknown")
    return summarize(metrics)


def results_dir_from_env(default: str = "results") -> Path:
    """The results folder notebooks read: $LAB_RESULTS, else `default` relative to the repository root."""
    import os
    value = os.environ.get("LAB_RESULTS")
    if value:
        return Path(value).expanduser().resolve()
    p = Path(default)
    return p if p.is_absolute() else (Path(__file__).resolve().parents[2] / p)


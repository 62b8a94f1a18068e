"""The study's replay tables: every FP16 policy of the study replayed on every run, and how well replay predicts
the real runs (``python -m lab replay-table``; the Snakemake rule `replay`).

* ``replay.csv``: one row per (run, replayed mode): lab.diagnose.replay over that run with the mode's policy and
  parameters, as the study's config.yaml files give them.
* ``replay_agreement.csv`` / ``.md``: the validation. Each FP16 mode replayed on the FP32 run of the same family
  and seed, against that mode's real run: overflow steps, skipped steps, final scale, the share of steps whose
  scale replay got right, and the flushed shares. Per family and mode, over the seeds both exist for.

Replay on an FP32 run predicts an FP16 run from what FP32 recorded; the two runs part ways at the first skipped
step (the FP16 run keeps its weights, the FP32 run does not skip) and their backwards differ in rounding, so the
agreement is what the approximation is worth, measured (docs/replay.md).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lab.core import files, runfiles
from lab.diagnose.replay import ReplayError, read_run, replay
from lab.report.load import mode_order, model_order, run_dirs, run_identity

__all__ = ["study_policies", "replay_table", "agreement_table", "agreement_markdown", "write_replay_tables"]

COMPARED = ("overflow_steps", "skipped_steps", "final_scale", "flushed_activation", "flushed_param")


def _mode_of(run_dir: Path) -> dict:
    cfg = run_dir / "config.yaml"
    return runfiles.read_yaml(cfg).get("mode", {}) if cfg.is_file() else {}


def study_policies(dirs: list[Path]) -> dict[str, tuple[str, dict]]:
    """{mode name: (policy, params)} for every FP16 mode with a loss scaler among ``dirs``' config.yaml files."""
    out: dict[str, tuple[str, dict]] = {}
    for d in dirs:
        mode = _mode_of(d)
        scaler = dict(mode.get("scaler") or {})
        if mode.get("precision") == "fp16" and scaler.get("policy"):
            out.setdefault(mode["name"], (scaler.pop("policy"), scaler))
    return out


def replay_table(results, progress=None) -> tuple[pd.DataFrame, dict]:
    """(rows of every finished run x every FP16 mode's policy, each replayed run's per-step scales by
    (model, mode, seed, replayed mode))."""
    dirs = run_dirs(results, complete=True)
    policies = study_policies(dirs)
    rows, scales = [], {}
    for i, d in enumerate(dirs):
        ident = run_identity(d)
        try:
            record = read_run(d)
        except ReplayError as e:  # a run without grad_amax (made before the lab recorded it): said, not hidden
            print(f"replay: skipped {d}: {e}", file=progress) if progress else None
            continue
        for mode, (policy, params) in policies.items():
            out = replay(record, policy, params, trajectory=True)
            scales[(ident["model"], ident["mode"], ident["seed"], mode)] = [s for _, s, _, _ in out.pop("trajectory")]
            rows.append({**ident, "replayed_mode": mode, **out, "headroom": record.headroom})
        if progress:
            print(f"replay: {i + 1}/{len(dirs)} {d}", file=progress, flush=True)
    return pd.DataFrame(rows), scales


def _real_scales(results, model: str, mode: str, seed: int) -> list[float] | None:
    for d in run_dirs(results, model, mode, complete=True):
        if run_identity(d)["seed"] == seed:
            s = runfiles.read_csv_frame(d / "steps.csv", ["scale"], usecols=["scale"])["scale"]
            return [float(v) for v in s]
    return None


def agreement_table(results, table: pd.DataFrame, scales: dict) -> pd.DataFrame:
    """Replay on each FP32 run against the real run of the replayed mode (same family and seed); one row per
    (family, mode): seeds, real and replayed means of COMPARED, exact matches, and the share of steps whose
    replayed scale equals the real one."""
    from lab.report.load import load_metrics

    metrics = load_metrics(results)
    if table.empty or metrics.empty:
        return pd.DataFrame()
    real = metrics.set_index(["model", "mode", "seed"])
    ref = table[table["mode"] == "fp32"]
    rows = []
    for (model, mode), grp in ref.groupby(["model", "replayed_mode"]):
        pairs = []
        for _, r in grp.iterrows():
            key = (model, mode, r["seed"])
            if key not in real.index:
                continue
            got = real.loc[key]
            real_s = _real_scales(results, model, mode, int(r["seed"])) or []
            rep_s = scales.get((model, "fp32", r["seed"], mode), [])
            n = min(len(real_s), len(rep_s))
            pairs.append((r, got, sum(a == b for a, b in zip(real_s[:n], rep_s[:n])) / n if n else math.nan))
        if not pairs:
            continue
        row = {"model": model, "mode": mode, "policy": pairs[0][0]["policy"], "n_seeds": len(pairs),
               "headroom": max(int(p[0]["headroom"]) for p in pairs)}
        for col in COMPARED:
            rv = [float(p[1][col]) if p[1][col] is not None else math.nan for p in pairs]
            pv = [float(p[0][col]) if p[0][col] is not None else math.nan for p in pairs]
            row[f"{col}_real"], row[f"{col}_replay"] = _mean(rv), _mean(pv)
            if col in ("overflow_steps", "skipped_steps", "final_scale"):
                row[f"{col}_exact"] = sum(a == b for a, b in zip(rv, pv))
        row["scale_steps_equal"] = _mean([p[2] for p in pairs])
        row["uncertain_steps"] = _mean([float(p[0]["uncertain_steps"]) for p in pairs])
        rows.append(row)
    if not rows:  # no FP32 run beside a real run of a replayed mode (a study of FP16 runs only)
        return pd.DataFrame()
    out = pd.DataFrame(rows)
    m_rank = {m: i for i, m in enumerate(model_order(out["model"]))}
    o_rank = {m: i for i, m in enumerate(mode_order(out["mode"]))}
    out["_m"], out["_o"] = out["model"].map(m_rank), out["mode"].map(o_rank)
    return out.sort_values(["_m", "_o"]).drop(columns=["_m", "_o"]).reset_index(drop=True)


def _mean(values: list[float]) -> float:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.2f}%"


def agreement_markdown(agree: pd.DataFrame) -> str:
    """The agreement table as Markdown (means over seeds; k/n: seeds where replay equals the real run exactly)."""
    if agree.empty:
        return "No FP32 run with a real FP16 run of the same family and seed to compare replay with.\n"
    lines = ["| model | mode | seeds | overflow steps real / replay (exact) | skipped real / replay (exact) | "
             "final scale real / replay (exact) | steps at the real scale | flushed param real / replay | "
             "flushed activation real / replay |", "|" + "---|" * 9]
    for _, r in agree.iterrows():
        n = int(r["n_seeds"])
        lines.append(
            f"| {r['model']} | {r['mode']} | {n} | {r['overflow_steps_real']:.1f} / {r['overflow_steps_replay']:.1f} "
            f"({int(r['overflow_steps_exact'])}/{n}) | {r['skipped_steps_real']:.1f} / {r['skipped_steps_replay']:.1f} "
            f"({int(r['skipped_steps_exact'])}/{n}) | {r['final_scale_real']:g} / {r['final_scale_replay']:g} "
            f"({int(r['final_scale_exact'])}/{n}) | {_pct(r['scale_steps_equal'])} | "
            f"{_pct(r['flushed_param_real'])} / {_pct(r['flushed_param_replay'])} | "
            f"{_pct(r['flushed_activation_real'])} / {_pct(r['flushed_activation_replay'])} |")
    return "\n".join(lines) + "\n"


def write_replay_tables(results, csv: str | Path, agreement_csv: str | Path, agreement_md: str | Path,
                        progress=None) -> pd.DataFrame:
    """Write replay.csv and the agreement table (CSV and Markdown), atomically; returns the agreement frame."""
    table, scales = replay_table(results, progress)
    agree = agreement_table(results, table, scales)
    files.atomic_write_text(Path(csv), table.to_csv(index=False))
    files.atomic_write_text(Path(agreement_csv), agree.to_csv(index=False))
    files.atomic_write_text(Path(agreement_md), agreement_markdown(agree))
    return agree

"""`lab judge-controllers`: every scale rule replayed on held-out runs, as tables and Pareto figures.

FP16 (controllers_fp16.csv/.md): every registered loss-scaling policy at its defaults (the hand-written ones),
``amax-predicted`` with each hand-written predictor, and the learned ones (``amax-predicted`` with the ``learned``
predictor, ``rl-controller``) from the models fitted without the run's family (``<name>-without-<family>.json``):
a learned rule is judged only on runs of seeds and a family it did not learn from. Per family and rule: skipped
steps per run and the flushed share of the activation and parameter gradients, pooled over its runs (the replay's
model, lab/diagnose/replay.py); ``front``: no other rule of the family skips no more and flushes no more, one of
them strictly less (the Pareto front).

FP8 (controllers_fp8.csv/.md): every predictor at history lengths 16, 128 and 1024 over the held-out runs' amax
histories (judge.py): clipped steps and unused binades per role.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lab.core import files

HISTORY_LENS = (16, 128, 1024)
FP16_COLUMNS = ("family", "policy", "kind", "runs", "skipped_per_run", "overflow_per_run", "uncertain_steps",
                "flushed_activation", "flushed_param", "front")


def _family(info: dict) -> str:
    return str(info["model"]).removesuffix("_learn")


def held_out_model(models: Path, name: str, family: str) -> Path:
    """The artefact that judges `family`: `<name>-without-<family>.json` where the study fitted one (learn on the
    other families), else `<name>.json` if no run it learned from is of that family (a family held out whole, as
    the multimodal one); a ValueError where neither holds (the judgement would leak)."""
    import json
    without = models / f"{name}-without-{family}.json"
    if without.is_file():
        return without
    full = models / f"{name}.json"
    seen = {_family(r) for r in json.loads(full.read_text())["runs"]}
    if family in seen:
        raise ValueError(f"{full} learned from family {family!r} and no {without.name} holds it out: "
                         f"fit one without it (configs/controllers.yaml `controllers:`)")
    return full


def fp16_policies(family: str, models: Path) -> list[tuple[str, str, dict]]:
    """(kind, policy name, params) judged on a family's runs."""
    import lab.scaling
    from lab.scaling.predictors import available_predictors
    learned = {"amax-predicted", "rl-controller"}
    out = [("hand-written", name, {}) for name in lab.scaling.available() if name not in learned]
    out.append(("hand-written", "static", {"scale": 1024.0}))  # static at its default is 128
    out += [("predictor", "amax-predicted", {"predictor": p}) for p in available_predictors()
            if p not in ("learned", "max")]  # max: amax-history itself
    out += [("learned", "amax-predicted",
             {"predictor": {"name": "learned", "model": str(held_out_model(models, "learned-fp16", family))}}),
            ("learned", "rl-controller", {"model": str(held_out_model(models, "rl-fp16", family))})]
    return out


def _label(name: str, params: dict) -> str:
    if not params:
        return name
    if name == "amax-predicted":
        p = params["predictor"]
        return f"amax-predicted:{p if isinstance(p, str) else p['name']}"
    if name == "rl-controller":
        return name
    return name + ":" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def pareto_front(xs, ys) -> list[bool]:
    """Which points (x, y), both lower-is-better, no other point dominates: none other is no higher in both and
    lower in one. A missing value (NaN) counts as the worst; points that coincide are on the front together."""
    pts = [(math.inf if math.isnan(x) else x, math.inf if math.isnan(y) else y) for x, y in zip(xs, ys)]
    return [not any(x2 <= x and y2 <= y and (x2 < x or y2 < y) for x2, y2 in pts) for x, y in pts]


def judge_fp16(runs: list[str], models: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per run and rule, one row per family and rule)."""
    from lab.diagnose.replay import ReplayError, read_run, replay
    from lab.scaling.learning.histories import run_info
    rows, policies = [], {}
    for run in runs:
        info = run_info(run)
        try:
            record = read_run(run)
        except ReplayError:
            continue
        family = _family(info)
        if family not in policies:  # read each family's held-out artefacts once
            policies[family] = fp16_policies(family, models)
        for kind, name, params in policies[family]:
            r = replay(record, name, params)
            rows.append({"family": family, "seed": info["seed"], "run": run, "policy": _label(name, params),
                         "kind": kind, **{k: r[k] for k in ("skipped_steps", "overflow_steps", "uncertain_steps",
                                                             "flushed_activation", "flushed_param")}})
    per_run = pd.DataFrame(rows)
    if per_run.empty:
        return per_run, pd.DataFrame(columns=FP16_COLUMNS)
    g = per_run.groupby(["family", "policy", "kind"], sort=False)
    summary = g.agg(runs=("run", "count"), skipped_per_run=("skipped_steps", "mean"),
                    overflow_per_run=("overflow_steps", "mean"), uncertain_steps=("uncertain_steps", "sum"),
                    flushed_activation=("flushed_activation", "mean"), flushed_param=("flushed_param", "mean"))
    summary = summary.reset_index()
    summary["front"] = False
    for family, idx in summary.groupby("family").groups.items():
        summary.loc[idx, "front"] = pareto_front(summary.loc[idx, "skipped_per_run"],
                                                 summary.loc[idx, "flushed_activation"])
    return per_run, summary[list(FP16_COLUMNS)]


def judge_fp8(runs: list[str], models: Path) -> pd.DataFrame:
    from lab.scaling.learning import histories
    from lab.scaling.learning.histories import run_info
    from lab.scaling.learning.judge import judge
    from lab.scaling.predictors import available_predictors
    by_family: dict[str, list] = {}
    for run in runs:
        by_family.setdefault(_family(run_info(run)), []).extend(histories.read([run], "fp8"))
    rows = []
    for family, hs in sorted(by_family.items()):
        for name in available_predictors():
            spec = {"name": "learned", "model": str(models / "learned-fp8.json")} if name == "learned" else name
            for n in HISTORY_LENS:
                rows += [{"family": family, **r} for r in judge(hs, spec, n)]
    return pd.DataFrame(rows)


def _md(df: pd.DataFrame, title: str, note: str) -> str:
    def cell(v):
        if isinstance(v, float):
            return "—" if math.isnan(v) else f"{v:.4g}"
        return str(v)
    lines = [f"# {title}", "", note, "", "| " + " | ".join(df.columns) + " |",
             "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def figures(summary: pd.DataFrame, fp8: pd.DataFrame, out: Path) -> list[Path]:
    """One Pareto figure per FP16 family (skipped steps per run against the flushed activation share) and one per
    FP8 family (clipped steps against unused binades of the output gradients), the front drawn, every rule
    numbered with its key beside (lab/report/pareto_figure.py)."""
    from lab.report.pareto_figure import pareto_figure
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    colors = {"hand-written": "tab:gray", "predictor": "tab:blue", "learned": "tab:red"}
    for family, df in summary.groupby("family"):
        points = pd.DataFrame({"x": 100 * df["flushed_activation"], "y": df["skipped_per_run"],
                               "name": df["policy"], "kind": df["kind"]})
        labels = {"xlabel": "flushed activation gradients (%, replayed; symlog)",
                  "ylabel": "skipped steps per run (replayed; symlog)",
                  "title": f"{family}: FP16 rules on held-out runs"}
        # both symlog: zero (no flush, no skip) stays on the axes, and the few-skip rules stand apart from
        # hysteresis' twenty
        scales = {"x": {"value": "symlog", "linthresh": 1e-4}, "y": {"value": "symlog", "linthresh": 1}}
        paths.append(pareto_figure(points, pareto_front(points["x"], points["y"]), colors, labels,
                                   out / f"controllers_fp16_{family}.png", scales))
    grads = fp8[fp8["role"] == "grad_output"] if len(fp8) else fp8
    for family, df in (grads.groupby("family") if len(grads) else []):
        name = df["predictor"].str.split(":").str[0]
        points = pd.DataFrame({"x": df["unused_binades"], "y": df["clipped_pct"],
                               "name": name + ", history " + df["history_len"].astype(str),
                               "kind": name.where(name == "learned", "predictor")})
        labels = {"xlabel": "unused binades at the top (output gradients)", "ylabel": "clipped steps (%)",
                  "title": f"{family}: FP8 delayed-scale predictors on held-out runs"}
        paths.append(pareto_figure(points, pareto_front(points["x"], points["y"]), colors, labels,
                                   out / f"controllers_fp8_{family}.png"))
    return paths


def load_tables(results) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(controllers_fp16.csv, controllers_fp8.csv) of a results folder, empty where absent (the notebook's)."""
    from lab.core import runfiles
    out = []
    for name in ("controllers_fp16.csv", "controllers_fp8.csv"):
        path = Path(results) / "tables" / name
        out.append(runfiles.read_csv_frame(path) if path.is_file() and path.stat().st_size > 1 else pd.DataFrame())
    return out[0], out[1]


def controller_learned(results) -> dict | None:
    """What the study's RL controller learned (its artefact's `learned`, and its last iterations' mean return)."""
    from lab.scaling.learning import artefact
    path = Path(results) / "models" / "rl-fp16.json"
    if not path.is_file():
        return None
    data = artefact.load(str(path), "rl-fp16", "rl-linear")
    return {**data["learned"], "final_return": round(sum(data["curve"][-10:]) / len(data["curve"][-10:]), 3)}


def main(args) -> int:
    models, out = Path(args.models), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_run, summary = judge_fp16(args.fp16, models)
    fp8 = judge_fp8(args.fp8, models) if args.fp8 else pd.DataFrame()
    files.atomic_write_text(out / "controllers_fp16_runs.csv", per_run.to_csv(index=False, lineterminator="\n"))
    files.atomic_write_text(out / "controllers_fp16.csv", summary.to_csv(index=False, lineterminator="\n"))
    files.atomic_write_text(out / "controllers_fp16.md", _md(summary, "FP16 scale rules on held-out runs (replay)", (
        "Replayed on FP32 runs of seeds no learned rule learned from, each learned rule fitted without the run's "
        "family. skipped/overflow: per run; flushed: the share of non-zero gradient values the rule's scale "
        "flushes at the census steps, mean over runs; front: on the family's Pareto front (lab/scaling/learning/"
        "tables.py).")))
    files.atomic_write_text(out / "controllers_fp8.csv", fp8.to_csv(index=False, lineterminator="\n"))
    if len(fp8):
        files.atomic_write_text(out / "controllers_fp8.md", _md(fp8, "FP8 delayed-scale predictors on held-out "
                                "histories", "clipped: steps whose amax exceeded the predicted amax x 2^margin "
                                "(saturation); unused binades: how far under the format's top the tensor's "
                                "largest value sat otherwise; exceeded: the amax above the prediction (for learned, "
                                "1 - its quantile if calibrated). lab/scaling/learning/judge.py."))
    if args.figures:
        figures(summary, fp8, Path(args.figures))
    print(f"judged {summary['runs'].sum() if len(summary) else 0} FP16 (run, rule) pairs and {len(fp8)} FP8 rows "
          f"-> {out}")
    return 0

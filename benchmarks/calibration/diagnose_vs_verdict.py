"""`lab diagnose` checked against the study's own outcomes: every FP16 run's diagnosis next to the paired
validation-loss verdict of its (model, mode) row in the summary table.

A run whose cost is resolved must not be told "Nothing to change"; a run equivalent to FP32 should get no
underflow warning. Writes one row per run (CSV and Markdown) and prints the runs that break either rule.

    python benchmarks/calibration/diagnose_vs_verdict.py [RESULTS_DIR ...] [--out results/benchmarks/diagnose_vs_verdict]

Each RESULTS_DIR holds runs/ and tables/summary.csv (default: results/). Without a study's runs on the machine
(they are not committed), `--train DIR FAMILY:MODE:SEED ...` first trains those runs of configs/default.yaml into
DIR/runs and judges them against the committed results/tables/summary.csv (a sample, not the whole study):

    python benchmarks/calibration/diagnose_vs_verdict.py --train /tmp/calib lm:fp16-noscale:12 vit:fp16-noscale:2 \
        --out results/benchmarks/precision_lost

`coarse_act`: the share of what FP32 keeps that FP16 held with fewer significant bits than BF16's 8, flushed values
included (lab/diagnose/underflow.py COARSE_MATERIAL).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402
from lab.diagnose import diagnose  # noqa: E402
from lab.report import load as R  # noqa: E402


def rows_for(results_dir: Path) -> list[dict]:
    summary = pd.read_csv(results_dir / "tables" / "summary.csv").set_index(["model", "mode"])
    out = []
    for run_dir in R.run_dirs(results_dir, complete=True):
        d = diagnose(run_dir)
        if d.precision != "fp16":
            continue
        row = summary.loc[(d.model, d.mode)] if (d.model, d.mode) in summary.index else None
        loss = (d.fp16_loss or {}).get("sources", {}).get("activation_grad", {})
        if not loss:  # no FP32 replay in this run: nothing measured to judge
            continue
        underflow = next((f for f in d.findings if f.code == "fp16_underflow"), None)
        out.append({
            "study": results_dir.name, "model": d.model, "mode": d.mode, "seed": d.seed,
            "flushed_act": loss.get("flushed"), "subnormal_act": loss.get("subnormal"), "coarse_act": loss.get("coarse"),
            "underflow_finding": underflow.severity if underflow else "",
            "diagnosis": d.verdict, "first_recommendation": d.recommendations[0].code if d.recommendations else "",
            "val_loss_delta": None if row is None else row["val_loss_delta"],
            "val_loss_ci": None if row is None else row["val_loss_delta_ci"],
            "val_loss_verdict": None if row is None else row["val_loss_verdict"]})
    return out


def train_sample(into: Path, specs: list[str]) -> Path:
    """Train FAMILY:MODE:SEED runs of configs/default.yaml into `into`/runs, next to a copy of the committed
    summary table; returns `into` (a results directory rows_for reads)."""
    import shutil
    from lab.core.config import load_study, resolve_run
    from lab.run.train import train
    study = load_study([str(REPO / "configs" / "default.yaml")])
    for spec in specs:
        family, mode, seed = spec.split(":")
        out = into / "runs" / family / mode / f"seed{seed}"
        if not (out / "metrics.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            train(resolve_run(study, family, mode, int(seed)), out)
    (into / "tables").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "results" / "tables" / "summary.csv", into / "tables" / "summary.csv")
    return into


def broken(t: pd.DataFrame) -> pd.DataFrame:
    """Rows that break a rule: a resolved cost told 'healthy' / 'Nothing to change'; an equivalent run warned
    about underflow."""
    cost_ok = (t["val_loss_verdict"] == "cost") & (t["first_recommendation"] == "healthy")
    eq_warned = (t["val_loss_verdict"] == "equivalent") & t["underflow_finding"].isin(["warning", "problem"])
    return t[cost_ok | eq_warned]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="*", default=[str(REPO / "results")])
    p.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "diagnose_vs_verdict"))
    p.add_argument("--train", nargs="+", metavar=("DIR", "FAMILY:MODE:SEED"),
                   help="train these runs of configs/default.yaml into DIR first and judge them")
    args = p.parse_args()
    results = [train_sample(Path(args.train[0]), args.train[1:])] if args.train else args.results
    table = pd.DataFrame([r for d in results for r in rows_for(Path(d))])
    pct = table.copy()
    for c in ("flushed_act", "subnormal_act", "coarse_act"):
        pct[c] = (100 * pd.to_numeric(pct[c])).round(1)
    files.atomic_write_text(f"{args.out}.csv", table.to_csv(index=False))
    files.atomic_write_text(f"{args.out}.md", pct.to_markdown(index=False, floatfmt=".3f") + "\n")
    bad = broken(table)
    print(pct.to_string(index=False))
    print(f"\n{len(table)} FP16 runs; {len(bad)} break a rule" + (":\n" + bad.to_string(index=False) if len(bad)
                                                                 else ""))
    print(f"wrote {args.out}.csv, {args.out}.md")
    return 1 if len(bad) else 0


if __name__ == "__main__":
    raise SystemExit(main())

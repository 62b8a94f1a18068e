"""The LM family's verdicts on CUDA beside the committed CPU study's: one row per mode, the
validation-loss difference against FP32 (same seeds, paired), its standard error and the table's verdict, from two
`lab aggregate` summaries: the CUDA runs' and results/tables/summary.csv (the CPU tensor-core contract).

    python benchmarks/gpu/lm_cuda_vs_cpu.py CUDA_SUMMARY.csv [--cpu results/tables/summary.csv] [--out F.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]


def cell(row) -> str:
    """'+0.2221 ± 0.0756 (cost)': the paired difference in nats, the half-width of its interval (the table's
    confidence, 95% by default), the verdict at the declared margin."""
    delta, half = row.get("val_loss_delta"), row.get("val_loss_delta_ci")
    if row.get("val_loss_verdict") == "reference":
        return "reference"
    if delta is None or pd.isna(delta):
        return "—"
    return f"{delta:+.4f} ± {half:.4f} ({row.get('val_loss_verdict') or 'n/a'})"


def rows_by_mode(path: Path, model: str) -> dict:
    table = pd.read_csv(path)
    table = table[table["model"] == model]
    return {r["mode"]: r for r in table.to_dict("records")}


def compare(cuda_csv: Path, cpu_csv: Path, model: str = "lm") -> str:
    cuda, cpu = rows_by_mode(cuda_csv, model), rows_by_mode(cpu_csv, model)
    device = next(iter(cuda.values()), {}).get("device", "?")  # the CPU in the rehearsal
    lines = [f"This run: {device}. The CPU study: results/tables/summary.csv (the tensor-core contract).\n",
             f"| {model} mode | CPU: val loss | CPU: Δ vs FP32 (nats) | this run: val loss | this run: Δ vs FP32 "
             "(nats) | this run: seeds (diverged) | this run: skipped steps |", "|---|---|---|---|---|---|---|"]
    margin = next((r["val_loss_margin"] for r in cuda.values() if not pd.isna(r.get("val_loss_margin"))), None)
    for mode in sorted(cuda, key=lambda m: (m != "fp32", m)):
        c, g = cpu.get(mode), cuda[mode]
        lines.append(f"| {mode} | {c['val_loss_mean']:.3f} | {cell(c)} | " if c is not None else f"| {mode} | — | not run | ")
        lines[-1] += (f"{g['val_loss_mean']:.3f} | {cell(g)} | {int(g['n_seeds'])} ({int(g['n_diverged'])}) | "
                      f"{g['skipped_count'] if not pd.isna(g.get('skipped_count')) else '—'} |")
    note = (f"\nΔ: paired over the seeds both ran, ± the half-width of its interval; verdicts at the declared margin "
            f"±{margin:g} nats, the table's error control (`lab aggregate`).\n" if margin else "")
    return "\n".join(lines) + "\n" + note


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cuda_csv", type=Path)
    ap.add_argument("--cpu", type=Path, default=REPO / "results" / "tables" / "summary.csv")
    ap.add_argument("--model", default="lm")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = compare(args.cuda_csv, args.cpu, args.model)
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

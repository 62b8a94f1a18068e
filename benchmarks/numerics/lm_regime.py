"""Where does FP16 without loss scaling start to cost a language model? A search over tokens per step.

The logit gradients of a language model are p / N for N tokens per optimizer step (the loss is averaged
over the whole step, as gradient accumulation does it), so the more tokens a step averages over, the more
of them fall under FP16's smallest subnormal 2^-24 at scale 1. This script trains the lab's LM family (the
real training loop, lab.run.train.train) for each configuration under FP32, FP16 without scaling and FP16 with
a static scale, for a few seeds, and writes one row per run: validation loss (bits per token), wall time,
and the FP32 run's counterfactual census: the share of non-zero activation / parameter gradients that FP16
would flush to zero at scale 1.

    python benchmarks/numerics/lm_regime.py [--accum 1 8 32] [--seeds 0 1] [--steps 60] [--micro-batch 64]
        [--context 32] [--preset gpt-tiny] [--vocab 4096] [--out results/benchmarks/lm_regime.csv]
        [--figure results/figures/lm_tokens_per_step.png] [--emulated]

--emulated adds, for every D in --accum, the same step size reached by train.emulated_accum = D on one
micro-batch (the backward magnitudes of a D-way step at 1/D of the compute), so real and emulated
accumulation are compared at the same tokens per step: the FP32 runs' counterfactual underflow shares and the
cost of FP16 without scaling over the same steps (column `how`: real / emulated).

The figure: the paired cost of FP16 without scaling (validation bits per token minus FP32's, per seed) and
of FP16 at scale 1024, against tokens per optimizer step, with the FP32 runs' counterfactual underflow share.
"""
from __future__ import annotations

import argparse
import copy
import io
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402
from lab.core.config import resolve_run, validate_study  # noqa: E402
from lab.run.train import train  # noqa: E402

MODES = {"fp32": {"precision": "fp32"},
         "fp16-noscale": {"precision": "fp16", "scaler": {"policy": "none"}},
         "fp16-static1024": {"precision": "fp16", "scaler": {"policy": "static", "scale": 1024}}}


def study_for(args, accum: int, emulated: int = 1) -> dict:
    study = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    study["models"] = {"lm": {"preset": args.preset, "data": {"name": "pydoc", "context": args.context,
                                                             "vocab_size": args.vocab, "val_fraction": 0.1}}}
    study["modes"] = MODES
    study["train"].update(epochs=1000, max_steps=args.steps, batch_size=args.micro_batch, accum_steps=accum,
                          emulated_accum=emulated, lr=args.lr, census_every=max(1, args.steps // 4), log_every=10)
    return validate_study(study)


def underflow_share(run_dir: Path, source: str) -> float:
    """Share of non-zero gradient values an FP16 cast at scale 1 flushes to zero (FP32 run, all census steps)."""
    census = pd.read_csv(run_dir / "census.csv")
    rows = census[(census["layer"] == "__total__") & (census["source"] == source) & (census["at_scale"] == 1)]
    nonzero = (rows["total"] - rows["zero"]).sum()
    return float(rows["underflow"].sum() / nonzero) if nonzero else float("nan")


def fp16_shares(run_dir: Path, source: str = "activation_grad") -> tuple[float, float]:
    """An FP16 run's own census: the shares of its gradient values that are exactly zero and subnormal."""
    census = pd.read_csv(run_dir / "census.csv")
    rows = census[(census["layer"] == "__total__") & (census["source"] == source)
                  & (census["at_scale"] == census["scale"])]
    total = rows["total"].sum()
    return (float(rows["zero"].sum() / total), float(rows["subnormal"].sum() / total)) if total else (
        float("nan"), float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--preset", default="gpt-tiny")
    p.add_argument("--out", default="results/benchmarks/lm_regime.csv")
    p.add_argument("--figure", default="results/figures/lm_tokens_per_step.png")
    p.add_argument("--emulated", action="store_true", help="also each D as emulated_accum on one micro-batch")
    args = p.parse_args()
    rows = []
    grid = [(a, 1, "real") for a in args.accum] + ([(1, a, "emulated") for a in args.accum if a > 1]
                                                   if args.emulated else [])
    with tempfile.TemporaryDirectory() as tmp:
        for accum, emulated, how in grid:
            study = study_for(args, accum, emulated)
            for seed in args.seeds:
                for mode in args.modes:
                    run_dir = Path(tmp) / f"a{accum}-e{emulated}-{mode}-s{seed}"
                    m = train(resolve_run(copy.deepcopy(study), "lm", mode, seed), run_dir, progress=io.StringIO())
                    row = {"preset": args.preset, "context": args.context, "micro_batch": args.micro_batch,
                           "how": how, "accum_steps": accum, "emulated_accum": emulated,
                           "tokens_per_step": m["regime_tokens_per_step"], "steps": m["steps"],
                           "mode": mode, "seed": seed, "val_bits_per_token": m["val_bits_per_token"],
                           "final_top1": m["final_top1"], "overflow_steps": m["overflow_steps"],
                           "wall_s": m["wall_s"]}
                    if mode == "fp16-noscale":
                        row["fp16_zero_activation_grad"], row["fp16_subnormal_activation_grad"] = fp16_shares(run_dir)
                    if mode == "fp32":
                        row["fp32_underflow_activation_grad"] = underflow_share(run_dir, "activation_grad")
                        row["fp32_underflow_param_grad"] = underflow_share(run_dir, "param_grad")
                    rows.append(row)
                    print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in row.items()), flush=True)
    table = pd.DataFrame(rows)
    files.atomic_write_text(args.out, table.to_csv(index=False))
    pivot = table.pivot_table(index=["how", "tokens_per_step", "seed"], columns="mode", values="val_bits_per_token")
    print(pivot.round(3).to_string())
    if "fp32" in args.modes and len(args.modes) > 1 and not args.emulated:
        threshold_figure(table, args.figure)
    drew = "fp32" in args.modes and len(args.modes) > 1 and not args.emulated
    print(f"wrote {args.out}{', ' + args.figure if drew else ''} ({files.cpu_name()})")


def threshold_figure(table: pd.DataFrame, out) -> None:
    from lab.report.figures import new_figure, save
    fig = new_figure(8, 4.5)
    ax = fig.subplots()
    ref = table[table["mode"] == "fp32"].set_index(["tokens_per_step", "seed"])["val_bits_per_token"]
    for mode, marker in (("fp16-noscale", "o"), ("fp16-static1024", "s")):
        rows = table[table["mode"] == mode].set_index(["tokens_per_step", "seed"])["val_bits_per_token"]
        delta = (rows - ref).dropna().reset_index()
        if delta.empty:
            continue
        ax.plot(delta["tokens_per_step"], delta["val_bits_per_token"], marker, alpha=0.5, label=f"{mode}, per seed")
        mean = delta.groupby("tokens_per_step")["val_bits_per_token"].mean()
        ax.plot(mean.index, mean.values, "-", lw=1.5, label=f"{mode}, mean")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per optimizer step (loss averaged over the step)")
    ax.set_ylabel("validation bits/token minus FP32 (same seed)")
    under = table[table["mode"] == "fp32"].groupby("tokens_per_step")["fp32_underflow_activation_grad"].mean()
    twin = ax.twinx()
    twin.plot(under.index, 100 * under.values, "k--", lw=1, label="FP32 activation gradients under 2^-24 (%)")
    twin.set_ylabel("FP32 activation gradients FP16 flushes at scale 1 (%)")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=7, loc="upper left")
    ax.set_title("When FP16 without loss scaling starts to cost a language model", fontsize=10)
    save(fig, out)


if __name__ == "__main__":
    main()

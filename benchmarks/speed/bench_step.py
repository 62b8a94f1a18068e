"""The training step, side by side in one process: a bare PyTorch FP32 step, the lab's FP32 step and the lab's step
in every other mode of each study family.

Per family of the study config: a bare step (the family's preset, batch and input size, AdamW with the config's lr
and weight decay, the flattened cross-entropy, forward/backward/step/zero_grad: nothing else) and, for each mode, the
lab's own loop (lab.run.train.build_loop: the scaler, the census on its cadence and its FP32 replay, the overflow
attribution, the per-step log rows and their flush, the schedule; lab.run.loop.EpochLoop.feed, exactly what a run
executes per batch). Every variant trains from the same initial weights on the same pre-loaded batches (data loading
is not timed: it is the same for all). Timing: cycles of one census interval of steps per variant (so each
variant's cycle holds exactly one census step, as a run's interval does), within a cycle the variants interleaved in
sub-blocks of a few steps (a slow spell of this shared machine, seconds long, then hits every variant alike); per
variant the figure is the median over cycles of its cycle's mean step time, and each ratio the median over cycles of
the ratio within a cycle (paired: the two variants ran side by side), with the range of the per-cycle ratios beside
it. The verdict: lab FP32 within 1.1x the bare step, and every other mode within 1.1x the lab FP32 step.

    python benchmarks/speed/bench_step.py [--config configs/default.yaml] [--families vit lm] [--rounds 5]
                                    [--threads 1] [--out results/benchmarks/step.json] [--md results/benchmarks/step.md]
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.core.config import apply_overrides, load_study, resolve_run  # noqa: E402
from lab.run import distributed  # noqa: E402
from lab.run.checkpoint import SignalFlag  # noqa: E402
from lab.run.evaluation import flat_cross_entropy  # noqa: E402
from lab.run.process import keep_freed_memory, seed_everything, set_true_fp32  # noqa: E402
from lab.run.train import build_loop  # noqa: E402

LIMIT = 1.1  # lab FP32 / bare, and every mode / lab FP32


class BareStep:
    """The family's model and AdamW, nothing else: what a PyTorch user's FP32 loop costs."""

    def __init__(self, cfg, bundle, state_dict):
        self.model = cfg.model.build(bundle.num_classes, bundle.in_chans, bundle.input_size, "fp32")
        self.model.load_state_dict(state_dict)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.loss_fn = flat_cross_entropy()

    def feed(self, x, y, epoch: int) -> None:
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def lab_loop(study, family: str, mode: str, steps: int, write_dir: Path, signals, sets=()):
    """The lab's loop for (family, mode, seed 0), planned for ``steps`` optimizer steps (its schedule's length)."""
    cfg = apply_overrides(resolve_run(study, family, mode, 0), list(sets))
    cfg = apply_overrides(cfg, [f"train.max_steps={steps}", "train.epochs=1000", "train.checkpoint_minutes=0"])
    bundle = cfg.data.build()
    seed_everything(cfg.seed)
    write_dir.mkdir(parents=True)
    d = distributed.from_env("cpu")
    loop = build_loop(cfg, bundle, write_dir, write_dir, "cpu", io.StringIO(), d, [], signals)
    loop.model.train()
    return cfg, bundle, loop


def bench_family(study, family: str, modes: list[str], rounds: int, tmp: Path, sets=(), sub: int = 5) -> list[dict]:
    every = apply_overrides(resolve_run(study, family, modes[0], 0), list(sets)).train.census_every or 20
    variants = {}
    with SignalFlag() as signals:
        for mode in modes:
            cfg, bundle, loop = lab_loop(study, family, mode, every * (rounds + 1), tmp / family / mode, signals, sets)
            variants[mode] = loop
        variants = {"bare": BareStep(cfg, bundle, variants[modes[0]].model.state_dict()), **variants}
        loader = iter(variants[modes[0]].train_loader)
        batches = [next(loader) for _ in range(min(every, len(variants[modes[0]].train_loader)))]
        cycles = []  # per cycle: {variant: seconds for its `every` steps}
        for r in range(rounds + 1):  # cycle 0 warms up (allocations, kernel choices, the first census's setup)
            spent = dict.fromkeys(variants, 0.0)
            for start in range(0, every, sub):
                for name, v in variants.items():
                    t0 = time.perf_counter()
                    for i in range(start, min(start + sub, every)):
                        x, y = batches[i % len(batches)]
                        v.feed(x, y, 0)
                    spent[name] += time.perf_counter() - t0
            if r:
                cycles.append(spent)
    rows = []
    for name in variants:
        ms = [c[name] / every * 1000 for c in cycles]
        over_bare = [c[name] / c["bare"] for c in cycles]
        over_fp32 = [c[name] / c["fp32"] for c in cycles] if "fp32" in variants else None
        rows.append({"family": family, "variant": name, "ms_per_step": statistics.median(ms), "cycle_ms": ms,
                     "over_bare": statistics.median(over_bare), "over_bare_range": [min(over_bare), max(over_bare)],
                     "over_lab_fp32": statistics.median(over_fp32) if over_fp32 else None,
                     "over_lab_fp32_range": [min(over_fp32), max(over_fp32)] if over_fp32 else None,
                     "census_every": every, "sub_block_steps": sub})
    return rows


def markdown(rows: list[dict], cpu: dict, threads: int, rounds: int) -> str:
    names = sorted({r["variant"] for r in rows} - {"bare"}, key=_order)
    lines = [f"Training step per family, side by side in one process (`python benchmarks/speed/bench_step.py`): "
             f"{cpu['model']} ({cpu['cores']} cores, torch CPU capability {cpu['torch_cpu_capability']}), "
             f"{threads} torch thread(s), {rounds} cycles of one census interval of steps per variant, the variants "
             f"interleaved within a cycle in blocks of a few steps; ms per step, median over cycles (the ratio to the "
             f"lab's FP32 step, the lab's FP32 step's to the bare step: median of the per-cycle ratios, their range in "
             f"brackets).", "",
             "| family | bare FP32 | " + " | ".join(names) + " |"]
    lines.append("|---" * (len(names) + 2) + "|")
    for family in dict.fromkeys(r["family"] for r in rows):
        got = {r["variant"]: r for r in rows if r["family"] == family}
        cells = [f"{got['bare']['ms_per_step']:.1f}"]
        for n in names:
            r = got.get(n)
            if r is None:
                cells.append("—")
            elif n == "fp32":
                lo, hi = r["over_bare_range"]
                cells.append(f"{r['ms_per_step']:.1f} ({r['over_bare']:.2f}x bare [{lo:.2f}-{hi:.2f}])")
            else:
                lo, hi = r["over_lab_fp32_range"]
                cells.append(f"{r['ms_per_step']:.1f} ({r['over_lab_fp32']:.2f}x [{lo:.2f}-{hi:.2f}])")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _order(name: str) -> tuple:
    known = ["fp32", "fp16-noscale", "fp16-static128", "fp16-static1024", "fp16-dynamic", "bf16"]
    return (known.index(name), name) if name in known else (len(known), name)


def verdict(rows: list[dict]) -> list[str]:
    """The rows over the limit, in words (empty: every family passes)."""
    bad = []
    for r in rows:
        if r["variant"] == "fp32" and r["over_bare"] > LIMIT:
            bad.append(f"{r['family']} lab fp32 {r['over_bare']:.2f}x the bare step")
        elif r["variant"] not in ("fp32", "bare") and r["over_lab_fp32"] and r["over_lab_fp32"] > LIMIT:
            bad.append(f"{r['family']} {r['variant']} {r['over_lab_fp32']:.2f}x the lab fp32 step")
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", help="study config (default: configs/default.yaml)")
    p.add_argument("--families", nargs="+", help="default: every family of the config")
    p.add_argument("--modes", nargs="+", help="default: each family's modes in the config")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override every run's setting, as lab train --set (e.g. train.census_every=40)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/benchmarks/step.json")
    p.add_argument("--md", default="results/benchmarks/step.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    set_true_fp32("cpu")
    keep_freed_memory()  # as every run does (lab/run/process.py); the bare step profits from it as much
    study = load_study(args.config)
    families = args.families or list(study["models"])
    cpu = files.cpu_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            modes = args.modes or resolve_modes(study, family)
            modes = ["fp32"] + [m for m in modes if m != "fp32"]
            t0 = time.perf_counter()
            got = bench_family(study, family, modes, args.rounds, Path(tmp), args.set)
            rows += got
            print(f"{family} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{r['variant']} {r['ms_per_step']:.1f} ms" for r in got), flush=True)
    table = markdown(rows, cpu, args.threads, args.rounds)
    bad = verdict(rows)
    print(table + (f"over {LIMIT}x: " + "; ".join(bad) if bad else f"every step within {LIMIT}x: PASS"))
    files.atomic_write_json(args.out, {"benchmark": "training step, bare vs lab modes", "limit": LIMIT,
                                       "threads": args.threads, "rounds": args.rounds, "cpu": cpu,
                                       "versions": files.package_versions(), "git": files.git_commit(),
                                       "time": files.now_iso(), "pass": not bad, "over_limit": bad, "rows": rows})
    files.atomic_write(args.md, lambda f: f.write(table + ("\nOver the limit: " + "; ".join(bad) if bad else
                                                           f"\nEvery step within {LIMIT}x.") + "\n"))
    print(f"wrote {args.out}, {args.md}")
    return 0 if not bad else 1


def resolve_modes(study, family: str) -> list[str]:
    return list(study["models"][family].get("modes") or study["modes"])


if __name__ == "__main__":
    sys.exit(main())

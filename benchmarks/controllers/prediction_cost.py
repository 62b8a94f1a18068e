"""What a predicted scale costs a training step (the bar: at most 1% over the same rule without it), side by
side in one process on the lab's own loop (benchmarks/speed/bench_step.py's `bench_family`: the same initial weights
and pre-loaded batches, the variants interleaved in blocks of a few steps within each cycle of one census interval).

* FP8, the LM of configs/controllers.yaml: delayed scaling from each predictor (ema, trend, learned; TE's max is
  the reference: the same recipe, its history read by another rule) and recording every tensor's amax at every step
  (fp8-current against fp8-current with the record switched off);
* FP16, the LM: amax-predicted (learned) and the RL controller against amax-history (the prediction runs on the
  host, on the observations the engine's one synchronisation per step fetches already).

    python benchmarks/controllers/prediction_cost.py [--rounds 5] [--out results/controllers/prediction_cost.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.core import files  # noqa: E402
from lab.core.config import load_study  # noqa: E402
from lab.run.process import keep_freed_memory, set_true_fp32  # noqa: E402

#: (variant, its reference): the same rule without the prediction or the record
PAIRS = [("fp8-delayed-ema", "fp8-delayed-h128"), ("fp8-delayed-trend", "fp8-delayed-h16"),
         ("fp8-delayed-learned", "fp8-delayed-h16"), ("fp8-current", "fp8-current (no amax record)"),
         ("fp16-learned", "fp16-amax"), ("fp16-rl", "fp16-amax")]
LIMIT = 1.01


def _bench_step():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "speed" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "controllers.yaml"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="results/controllers/prediction_cost.json")
    p.add_argument("--md", default="results/controllers/prediction_cost.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    set_true_fp32("cpu")
    keep_freed_memory()
    study = load_study([args.config])
    bench = _bench_step()
    modes = list(dict.fromkeys(m for pair in PAIRS for m in pair if not m.endswith("(no amax record)")))
    # the record switched off: a variant of fp8-current built by the same loop, its RecipeState told to stop
    original = bench.lab_loop

    def lab_loop(study, family, mode, *a, **k):
        if mode != "fp8-current (no amax record)":
            return original(study, family, mode, *a, **k)
        cfg, bundle, loop = original(study, family, "fp8-current", *a, **k)
        loop.recipe.amax.record(False)
        return cfg, bundle, loop
    bench.lab_loop = lab_loop
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench.bench_family(study, "lm", ["fp32"] + modes + ["fp8-current (no amax record)"], args.rounds,
                                  Path(tmp))
    got = {r["variant"]: r for r in rows}
    table = []
    for variant, ref in PAIRS:
        per = [a / b for a, b in zip(got[variant]["cycle_ms"], got[ref]["cycle_ms"])]
        table.append({"variant": variant, "reference": ref, "ms_per_step": got[variant]["ms_per_step"],
                      "reference_ms_per_step": got[ref]["ms_per_step"], "ratio": statistics.median(per),
                      "range": [min(per), max(per)]})
    parts = prediction_parts(study, bench, got)
    cpu = files.cpu_info()
    lines = [f"A predicted scale's cost per training step (`python benchmarks/controllers/prediction_cost.py`): the "
             f"LM of configs/controllers.yaml, {cpu['model']} ({cpu['cores']} cores), 1 torch thread, {args.rounds} "
             f"cycles, variants interleaved; ratio: median of the per-cycle ratios (range). Limit {LIMIT}x.", "",
             "| variant | against | ms per step | reference ms | ratio [range] |", "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['reference']} | {r['ms_per_step']:.1f} | {r['reference_ms_per_step']:.1f} | "
              f"{r['ratio']:.3f}x [{r['range'][0]:.3f}-{r['range'][1]:.3f}] |" for r in table]
    lines += ["", "The prediction (and the amax record) itself, timed alone (the part a step adds: the variant's per-step "
              f"prediction or record less the reference's, best of {PART_REPEATS} blocks of {PART_CALLS} calls, over the reference step's time "
              "above: a share the whole-step ratios' noise cannot hide):", "",
              "| variant | against | its prediction or record, us per step | reference's, us | added share of a step |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['reference']} | {r['us']:.1f} | {r['reference_us']:.1f} | "
              f"{100 * r['added_share']:.3f}% |" for r in parts]
    md = "\n".join(lines) + "\n"
    print(md)
    files.atomic_write_json(args.out, {"benchmark": "predicted scale cost", "limit": LIMIT, "rounds": args.rounds,
                                       "cpu": cpu, "versions": files.package_versions(), "git": files.git_commit(),
                                       "time": files.now_iso(), "rows": table, "parts": parts})
    files.atomic_write_text(args.md, md)
    return 0


PART_CALLS, PART_REPEATS = 200, 7


def _best_us(fn) -> float:
    """The best of PART_REPEATS blocks of PART_CALLS calls, in microseconds per call (warmed up first)."""
    import time
    for _ in range(20):
        fn()
    best = math.inf
    for _ in range(PART_REPEATS):
        t0 = time.perf_counter()
        for _ in range(PART_CALLS):
            fn()
        best = min(best, (time.perf_counter() - t0) / PART_CALLS)
    return 1e6 * best


def prediction_parts(study, bench, got) -> list[dict]:
    """Each predicted rule's per-step prediction against its reference rule's, timed alone: FP8, `predict_all` over
    the LM's delayed layers with full histories of recorded-like amaxes; FP16, the policy's host `update` with a full
    window. The added share is (variant - reference) over the reference's measured step time."""
    from lab.fp8.linear import predict_all, recipe_layers
    from lab.scaling import create
    rows = []
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, bench.SignalFlag() as signals:
        for i, (variant, ref) in enumerate(PAIRS[:3]):
            times = []
            for mode in (variant, ref):
                _, _, loop = bench.lab_loop(study, "lm", mode, 10, Path(tmp) / f"{i}-{mode}", signals)
                layers = recipe_layers(loop.model)
                for m in layers:  # a full history: amaxes spread over a few binades, as recorded
                    m.amax_history.copy_(torch.exp2(torch.randn(m.amax_history.shape, generator=g) - 8))
                times.append(_best_us(lambda: predict_all(layers)))
            rows.append(_part(variant, ref, times, got))
        rows.append(record_part(study, bench, got, Path(tmp), signals))
    for variant, ref in PAIRS[4:]:
        times = []
        for mode in (variant, ref):
            cfg = study["modes"][mode]["scaler"]
            policy = create(cfg["policy"], **{k: v for k, v in cfg.items() if k != "policy"}).policy
            for step in range(64):  # a full window
                policy.update(1024.0, False, step, grad_amax=float(2.0 ** (-6 - step % 5)))
            times.append(_best_us(lambda: policy.update(1024.0, False, 64, grad_amax=0.01)))
        rows.append(_part(variant, ref, times, got))
    return rows


def record_part(study, bench, got, tmp: Path, signals) -> dict:
    """The amax record's per-step work, timed alone: a real fp8-current step of the LM gives each layer's operands'
    amaxes (what its quantization read: Quantized.amax); the record's part is those pushes and the step's reduction
    (AmaxRecord._reduce), against the same pushes with the record off (they return at once)."""
    from lab.fp8.amax_record import ROLES
    from lab.fp8.linear import recipe_layers
    _, bundle, loop = bench.lab_loop(study, "lm", "fp8-current", 10, tmp / "record", signals)
    x, y = next(iter(loop.train_loader))
    loop.feed(x, y, 0)  # one step: each layer's amax_taken holds that step's (role, amax) pushes
    record, layers = loop.recipe.amax, recipe_layers(loop.model)
    pushes = [(m, ROLES[r], a) for m in layers for r, a in m.amax_taken]
    operand = torch.zeros(())  # read only where no amax is given: never here

    def step():
        for m in layers:
            if m.amax_taken is not None:
                m.amax_taken.clear()
        for m, role, a in pushes:
            m.push_amax(role, operand, a)
        if record.on:
            record._reduce()
    times = []
    for on in (True, False):
        record.record(on)
        times.append(_best_us(step))
    return _part("fp8-current", "fp8-current (no amax record)", times, got)


def _part(variant, ref, times, got) -> dict:
    return {"variant": variant, "reference": ref, "us": times[0], "reference_us": times[1],
            "added_share": (times[0] - times[1]) / (1e3 * got[ref]["ms_per_step"])}


if __name__ == "__main__":
    sys.exit(main())

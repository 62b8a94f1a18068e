"""What `lab.record` costs a training loop: the same loop with and without the recorder, side by side.

Two copies of a study model, the same batch, FP16 under the lab's autocast (the CPU tensor-core contract on CPU)
with the lab's `dynamic` scaler, stepping in alternation (the order flips every pair): one plain, one recorded
(`lab.record` at its defaults: census every 100 steps, no replay). The ratio is the recorded loop's total time
over the plain loop's; also reported: the ratio without the census steps (the per-step cost) and what a census
step adds. Limit: 1.05.

    python benchmarks/speed/bench_record.py --out results/benchmarks/record.json
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lab  # noqa: E402
import lab.scaling  # noqa: E402
from lab.core import files  # noqa: E402
from lab.models.presets import create_model  # noqa: E402
from lab.numerics.precision import autocast_for  # noqa: E402
from bench_amax import FAMILIES as SHAPES, make_batch as batch  # noqa: E402  (the same families and batches)

LIMIT = 1.05
FAMILIES = {name: SHAPES[name] for name in ("resnet50-digits", "vit-tiny-digits", "gpt-tiny")}


class Loop:
    def __init__(self, model, x, y, out: Path | None, census_every: int):
        self.model, self.x, self.y = model, x, y
        self.opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every block does the same work
        self.scaler = lab.scaling.create("dynamic", device="cpu")
        self.rec = lab.record(model, self.scaler, out=out, census_every=census_every) if out else None

    def step(self):
        with autocast_for("fp16", "cpu"):
            out = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), self.y.reshape(-1))
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.rec is not None:
            self.rec.step(loss)
        self.opt.zero_grad(set_to_none=True)


def measure(name: str, steps: int, n: int, census_every: int, tmp: Path) -> dict:
    classes, chans, size = FAMILIES[name]
    torch.manual_seed(0)
    base = create_model(name, classes, chans, size)
    x, y = batch(name, n)
    loops = {"plain": Loop(copy.deepcopy(base), x, y, None, census_every),
             "recorded": Loop(copy.deepcopy(base), x, y, tmp / name, census_every)}
    for lp in loops.values():
        for _ in range(3):
            lp.step()
    # single steps alternate between the two loops (the order flips every pair), so drift on the machine falls on
    # both alike; a census step lands every census_every recorded steps, as in a recorded run
    times = {k: [] for k in loops}
    for i in range(steps):
        for k in (("plain", "recorded") if i % 2 == 0 else ("recorded", "plain")):
            t0 = time.perf_counter()
            loops[k].step()
            times[k].append(time.perf_counter() - t0)
    loops["recorded"].rec.close()
    plain, rec = times["plain"], times["recorded"]
    census = [i for i in range(len(rec)) if (i + 3) % census_every == 0]  # 3 warm-up steps were recorded first
    others = [i for i in range(len(rec)) if i not in set(census)]
    return {"steps": steps, "mean_ms": {"plain": 1e3 * statistics.mean(plain), "recorded": 1e3 * statistics.mean(rec)},
            "ratio": sum(rec) / sum(plain),
            "ratio_without_census_steps": sum(rec[i] for i in others) / sum(plain[i] for i in others),
            "census_step_extra_ms": 1e3 * (statistics.mean([rec[i] for i in census]) - statistics.mean(plain))
            if census else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/benchmarks/record.json")
    ap.add_argument("--steps", type=int, default=400, help="steps of each loop, alternating")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--census-every", type=int, default=100)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            r = results[name] = measure(name, args.steps, args.batch if name != "gpt-tiny" else 32,
                                        args.census_every, Path(tmp))
            print(f"{name:18s} plain {r['mean_ms']['plain']:.1f} ms/step, recorded {r['mean_ms']['recorded']:.1f} "
                  f"ms/step: ratio {r['ratio']:.3f} (limit {LIMIT}); without the census steps "
                  f"{r['ratio_without_census_steps']:.3f}; a census step " + (
                      f"+{r['census_step_extra_ms']:.0f} ms" if r["census_step_extra_ms"] is not None else
                      f"not measured (no census step in {args.steps} steps)"),
                  flush=True)
    report = {"benchmark": "bench_record", "command": " ".join(["python"] + sys.argv), "limit": LIMIT,
              "cpu": files.cpu_name(), "cpu_info": files.cpu_info(), "torch_threads": 1, "time": files.now_iso(),
              "versions": files.package_versions(), "census_every": args.census_every, "results": results,
              "meets_limit": all(r["ratio"] <= LIMIT for r in results.values())}
    files.atomic_write_json(Path(args.out), report)
    return report


if __name__ == "__main__":
    main()

"""Instructions of one warm training step, FP32 against the lab's FP16 (the tensor-core contract), counted by valgrind.

Wall time on a shared CPU moves by more than the differences worth seeing (bench_fp16_cpu.py's FP16/FP32 ratio has
ranged over 1.06x-1.46x between runs of one commit); the number of instructions a step executes does not. This
script counts them the way CodSpeed's CPU simulation does, with valgrind (callgrind, no cache simulation):

* the script runs itself once under ``valgrind --tool=callgrind --dump-before=sys_getallocatedblocks``, one torch
  thread, ``PYTHONHASHSEED=0``, at ``nice``. Callgrind writes its counters to a new file, and zeroes them, each time
  the process enters CPython's ``sys_getallocatedblocks`` (``sys.getallocatedblocks()``, which nothing else in a
  training step calls): that call is the marker, placed before and after each measured step, so each file holds
  exactly one step (plus the marker's own few hundred instructions), and the import of torch (~100 s under
  valgrind), model building and warm-up land in a file of their own, never counted;
* per model (bench_fp16_cpu.py's presets, batch and step: one place builds a step): WARMUP steps of each path first
  (allocation, oneDNN primitive creation, autograd's caches), then REPEATS rounds of one FP32 step and one FP16
  step, each after ``gc.collect()`` (a collection then starts every step at the same point, not where the previous
  step's allocations left the counter). Inputs and weights are the same for every step (no optimizer step).

The REPEATS rounds of one path in one process should give the same count; ``--against`` an earlier JSON gives the
relative difference between two processes. Both are printed and written. Per model, callgrind_annotate's
function-level counts of the first FP32 and FP16 steps say where the extra instructions go: by function (self
counts) and by ATen op (inclusive counts of ``at::_ops::<op>::call``, nested ops counted in each of their callers).

Valgrind does not emulate AVX-512: under it torch reports its AVX2 capability and takes its AVX2 kernels, so the
counts are those of an AVX2 machine whatever the CPU. A count is not a time (a cast is memory-bound, a GEMM
compute-bound): it is the instrument that sees a 5% change in the work, which wall time on this machine does not.

    python benchmarks/speed/count_instructions.py [--models ...] [--warmup 1] [--repeats 2] [--jobs 3]
        [--against results/benchmarks/fp16_cpu_instructions.json] [--out results/benchmarks/fp16_cpu_instructions.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MARKER = "sys_getallocatedblocks"  # CPython's C function behind sys.getallocatedblocks()
PATHS = ("fp32", "fp16-contract")
TOP = 12  # functions / ops listed per model


def inner(models: list[str], warmup: int, repeats: int, plan_file: str) -> None:
    """Under valgrind: each measured step between two markers; what each of callgrind's dumps holds goes to
    plan_file (a step's label, or None for what lies between steps: setup, warm-up, garbage collection)."""
    sys.path[:0] = [str(REPO), str(HERE)]
    import torch
    from bench_fp16_cpu import MODELS, build, step
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = dict(MODELS)
    dumps = []  # dumps[i]: what callgrind's (i+1)-th dump holds, the work since the marker before it

    def marker(holds):  # callgrind writes and zeroes its counters on entering sys_getallocatedblocks
        sys.getallocatedblocks()
        dumps.append(holds)
    for preset in models:
        model, x, y = build(preset, sizes[preset])
        for _ in range(warmup):
            for pth in PATHS:
                step(model, x, y, pth)
        for r in range(repeats):
            for pth in PATHS:
                gc.collect()  # outside the count; every step then starts from the collector's same state
                marker(None)
                step(model, x, y, pth)
                marker({"model": preset, "path": pth, "repeat": r})
        del model, x, y
    plan = {"dumps": dumps, "torch_cpu_capability_under_valgrind": torch.backends.cpu.get_cpu_capability()}
    Path(plan_file).write_text(json.dumps(plan))


def valgrind_command(model: str, warmup: int, repeats: int, work: Path) -> list[str]:
    """One valgrind process per model, measuring both paths; its dumps and plan land in work."""
    return ["nice", "-n", "10", "valgrind", "--tool=callgrind", f"--dump-before={MARKER}",
            f"--callgrind-out-file={work / 'cg.out'}", sys.executable, str(Path(__file__).resolve()), "--inner",
            "--models", model, "--warmup", str(warmup), "--repeats", str(repeats), "--plan", str(work / "plan.json")]


def run_valgrind(models: list[str], warmup: int, repeats: int, work: Path, jobs: int) -> dict[str, dict]:
    """Each model's valgrind process, up to `jobs` at a time; returns each model's plan."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    running, plans = {}, {}

    def finish(model):  # the first started is waited for first: the models take about as long as each other
        proc = running.pop(model)
        err = proc.communicate()[1]
        if proc.returncode != 0:
            sys.exit(f"valgrind failed for {model} ({proc.returncode}):\n{err[-4000:]}")
        plans[model] = json.loads((work / model / "plan.json").read_text())
    for model in models:
        (work / model).mkdir(parents=True, exist_ok=True)
        for old in (work / model).glob("cg.out*"):
            old.unlink()
        if len(running) >= jobs:
            finish(next(iter(running)))
        running[model] = subprocess.Popen(valgrind_command(model, warmup, repeats, work / model), env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while running:
        finish(next(iter(running)))
    return plans


def total(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError(f"{dump}: no totals line")


def annotate(dump: Path, inclusive: bool) -> dict[str, int]:
    """callgrind_annotate's instruction count per function (self, or inclusive of callees) of one dump."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", f"--inclusive={'yes' if inclusive else 'no'}",
                          str(dump)], capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    whole = total(dump)
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\([\s\d.]+%\)\s+(.+)$", line)
        if m and "PROGRAM TOTALS" not in line:
            name = re.sub(r"^[^:\[]*?:(?!:)", "", m.group(2), count=1)  # drop the source file, keep the function
            name = re.sub(r"\[(?:.*/)?([^/\]]+)\]$", r"[\1]", name)  # the object file by its base name
            counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    # the frames on the stack when the dump was taken (main, the interpreter's entry) carry the whole count even
    # as self counts: not a function's own work
    return {name: n for name, n in counts.items() if n != whole}


def top_differences(fp32: dict[str, int], fp16: dict[str, int], fewer: bool = False) -> list[dict]:
    """The TOP names with the most extra instructions under FP16 (or, with fewer, the most saved)."""
    rows = [{"function": n, "fp32": fp32.get(n, 0), "fp16": fp16.get(n, 0),
             "extra": fp16.get(n, 0) - fp32.get(n, 0)} for n in set(fp32) | set(fp16)]
    return sorted(rows, key=lambda r: r["extra"] if fewer else -r["extra"])[:TOP]


def aten_ops(counts: dict[str, int]) -> dict[str, int]:
    """Inclusive counts of the ATen ops' entry points, at::_ops::<op>::call, by op."""
    ops: dict[str, int] = {}
    for name, n in counts.items():
        m = re.match(r"at::_ops::(\w+)::call\(", name)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + n
    return ops


def summarise(plans: dict[str, dict], work: Path) -> list[dict]:
    counts: dict[tuple, list[int]] = {}
    first: dict[tuple, Path] = {}
    for model, plan in plans.items():
        dumps = sorted((work / model).glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        if len(dumps) != len(plan["dumps"]):
            sys.exit(f"{model}: expected {len(plan['dumps'])} callgrind dumps, found {len(dumps)}: "
                     f"was {MARKER} the marker?")
        for holds, dump in zip(plan["dumps"], dumps):
            if holds is not None:
                key = (holds["model"], holds["path"])
                counts.setdefault(key, []).append(total(dump))
                first.setdefault(key, dump)
    rows = []
    for m in plans:
        a, b = counts[(m, "fp32")], counts[(m, "fp16-contract")]
        spread = max(max(v) / min(v) - 1 for v in (a, b)) if len(a) > 1 else None  # one round: nothing to compare
        self32, self16 = annotate(first[(m, "fp32")], False), annotate(first[(m, "fp16-contract")], False)
        inc32, inc16 = annotate(first[(m, "fp32")], True), annotate(first[(m, "fp16-contract")], True)
        rows.append({"model": m, "fp32_instructions": a[0], "fp16_instructions": b[0], "fp16_over_fp32": b[0] / a[0],
                     "fp32_repeats": a, "fp16_repeats": b, "repeat_rel_spread": spread,
                     "extra_by_function": top_differences(self32, self16),
                     "fewer_by_function": top_differences(self32, self16, fewer=True),
                     "extra_by_aten_op": top_differences(aten_ops(inc32), aten_ops(inc16))})
    return rows


def compare(rows: list[dict], against: str) -> None:
    """Relative difference of each count from an earlier run's (another process: the cross-run determinism)."""
    earlier = json.loads(Path(against).read_text())
    old = {r["model"]: r for r in earlier["results"]}
    for r in rows:
        if r["model"] in old:
            o = old[r["model"]]
            r["against"] = {"file": against, "git": earlier.get("git")}
            for k in ("fp32_instructions", "fp16_instructions"):
                r["against"][k + "_rel_diff"] = r[k] / o[k] - 1
            print(f"{r['model']:20s} against {against}: fp32 {r['against']['fp32_instructions_rel_diff']:+.2e}, "
                  f"fp16 {r['against']['fp16_instructions_rel_diff']:+.2e}")


def short(name: str, width: int = 100) -> str:
    """A C++ function's name for a table: TensorIterator's loop wrapper, namespaces and argument lists left out."""
    name = name.replace("void c10::function_ref<void (char**, long const*, long, long)>::callback_fn<", "loop<")
    for noise in ("(anonymous namespace)::", "at::native::", "at::vec::", "AVX2::"):
        name = name.replace(noise, "")
    name = re.sub(r"\((?:[^()]|\([^()]*\))*\)(?= |$|::| const)", "()", name)  # argument lists
    return name if len(name) <= width else name[:width - 3] + "..."


def markdown(report: dict, top: int = 6) -> str:
    """The committed table: counts and ratio per model, where they were counted, and each model's largest
    extra instructions under FP16 by function and by ATen op."""
    git, v = report["git"], report["versions"]
    lines = ["# Instructions per training step, FP16 (the tensor-core contract) against FP32", "",
             f"`{report['command']}`; each model in its own process: `{report['valgrind_command']}`.", "",
             f"{report['valgrind']}; CPU {report['cpu']['model']} (torch's kernels under valgrind: "
             f"{', '.join(report['torch_cpu_capability_under_valgrind'])}); torch {v['torch']}, python {v['python']}; "
             f"commit {git['commit']}{' with local changes' if git['dirty'] else ''}; {report['time']}; one torch "
             f"thread; warm-up {report['warmup']} step(s) per path, then {report['repeats']} counted rounds.", "",
             "| model | FP32 instructions | FP16 instructions | FP16 / FP32 | repeated steps differ by (relative) |",
             "|---|---|---|---|---|"]
    for r in report["results"]:
        spread = "one round" if r["repeat_rel_spread"] is None else f"{r['repeat_rel_spread']:.1e}"
        if "against" in r:
            spread += (f"; FP32 {r['against']['fp32_instructions_rel_diff']:+.1e} against "
                       f"{(r['against']['git'] or {}).get('commit') or r['against']['file']}")
        lines.append(f"| {r['model']} | {r['fp32_instructions']:,} | {r['fp16_instructions']:,} | "
                     f"{r['fp16_over_fp32']:.3f} | {spread} |")
    for r in report["results"]:
        extra = r["fp16_instructions"] - r["fp32_instructions"]
        lines += ["", f"{r['model']}: FP16 executes {extra:+,} instructions; the largest differences", "",
                  "| by function (self) | FP32 | FP16 | difference "
                  "| by ATen op (inclusive) | FP32 | FP16 | difference |",
                  "|---|---|---|---|---|---|---|---|"]
        for f, o in zip(r["extra_by_function"][:top], r["extra_by_aten_op"][:top]):
            lines.append(f"| `{short(f['function'])}` | {f['fp32']:,} | {f['fp16']:,} | {f['extra']:+,} | "
                         f"`{o['function']}` | {o['fp32']:,} | {o['fp16']:,} | {o['extra']:+,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1, help="valgrind processes at a time (one per model)")
    p.add_argument("--against", help="an earlier output of this script: print each count's relative difference")
    p.add_argument("--keep", help="keep callgrind's files in this folder (callgrind_annotate reads them)")
    p.add_argument("--out", default="results/benchmarks/fp16_cpu_instructions.json")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path[:0] = [str(REPO), str(HERE)]
    if args.inner:
        return inner(args.models, args.warmup, args.repeats, args.plan)
    from bench_fp16_cpu import MODELS
    from lab.core import files
    models = args.models or [m for m, _ in MODELS]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="count_instructions."))
    t0 = time.time()
    plans = run_valgrind(models, args.warmup, args.repeats, work, args.jobs)
    rows = summarise(plans, work)
    for r in rows:
        print(f"{r['model']:20s} fp32 {r['fp32_instructions']:>14,}  fp16 {r['fp16_instructions']:>14,}  "
              f"ratio {r['fp16_over_fp32']:.4f}  (repeats within {r['repeat_rel_spread']:.1e})")
    if args.against:
        compare(rows, args.against)
    if not args.keep:
        shutil.rmtree(work)
    cpu = files.cpu_info()
    report = {"benchmark": "fp16_cpu instructions per training step (callgrind)", "warmup": args.warmup,
              "repeats": args.repeats, "command": " ".join(shlex.quote(c) for c in sys.argv),
              "valgrind_command": " ".join(shlex.quote(str(c)) for c in
                                           valgrind_command("MODEL", args.warmup, args.repeats, Path("WORK"))),
              "valgrind": subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip(),
              "cpu": cpu, "torch_cpu_capability_under_valgrind": sorted({p["torch_cpu_capability_under_valgrind"]
                                                             for p in plans.values()}),
              "versions": files.package_versions(), "git": files.git_commit(), "time": files.now_iso(),
              "wall_s": round(time.time() - t0), "results": rows}
    files.atomic_write_json(args.out, report)
    files.atomic_write_text(Path(args.out).with_suffix(".md"), markdown(report))
    print(f"wrote {args.out} and its .md ({report['wall_s']} s)")


if __name__ == "__main__":
    main()

"""Training throughput of the full-size model families, per precision, measured the way the field measures it.

For each family (the presets of configs/imagenet.yaml: ``resnet50``, ``mobilenetv2_100`` and
``vit_small_patch16`` at 224x224 with 1000 classes; ``gpt2-small`` at context 1024 with GPT-2's vocabulary
of 50257) and each precision:

* ``fp32``: true FP32, TF32 off in matmuls and convolutions (what the lab's ``fp32`` mode runs);
* ``tf32``: FP32 tensors with TF32 tensor-core math (PyTorch's cuDNN default; the precision of NVIDIA's
  published "TF32" numbers); CUDA only;
* ``fp16``: FP16 autocast with dynamic loss scaling, measured twice in one run: with
  ``torch.amp.GradScaler`` and with the lab's drop-in replacement ``lab.scaling.create("dynamic")``,
  blocks of steps alternating A/B (the order flips every round); the scaler's overhead is the median over
  rounds of the lab/PyTorch block-time ratio; each round also times a block of *census steps* (the lab's scaler
  with lab.numerics.monitor's census on every step: hooks on every leaf module's output gradient, the parameter
  gradients counted before unscale_, histograms; no FP32 replay), and ``census_step_ratio`` is the median over
  rounds of a census step's time over a plain lab step's;
* ``bf16``: BF16 autocast, no scaler.

It trains one step after another on synthetic data of the real shape (images N x 3 x 224 x 224 and labels,
or N x 1024 token ids and next-token targets, made once on the device, so no data loading is timed), after
warm-up steps (cuDNN autotuning, allocator), in timed blocks bracketed by ``torch.cuda.synchronize()`` and
``time.perf_counter()``. It reports samples/s (tokens/s for the LM), ms/step, the peak memory
(``torch.cuda.max_memory_allocated`` since the precision's model was built; on CPU the process's peak RSS,
which only grows) and the ratios between precisions. ``--channels-last`` (convolutional families) and
``--compile`` (``torch.compile``, compile time inside the warm-up) are optional. cuDNN benchmarking is on,
as NVIDIA's and timm's benchmarks have it (``--no-cudnn-benchmark`` to time what the lab's training loop
does with ``train.deterministic: true``; by default it autotunes as well).

Targets on a datacenter GPU: ResNet-50 FP16 at least 2.6x true FP32 (``fp16_over_fp32``), and the lab's
scaler within 1% of GradScaler (``scaler_time_ratio`` <= 1.01). NVIDIA's published A100 ratio, 2.63x
(DeepLearningExamples, PyTorch ResNet-50 v1.5, 1 GPU: 938 img/s TF32, 2470 img/s mixed precision), is
mixed precision over *TF32*: ``fp16_over_tf32`` is the number to set beside it.

On CPU (``--device cpu``) FP16/BF16 run under ``lab.numerics.precision.autocast_for``: CPU autocast with the lab's
tensor-core contract (lab/numerics/contract.py). ``--tiny`` swaps in the CPU study's small presets, small inputs and
batches and 1-2 timed steps, so the whole benchmark runs in seconds (tests/test_bench_throughput.py); its
numbers are a smoke test, not a measurement.

    python benchmarks/speed/bench_throughput.py --device cuda            # -> results/reference/<gpu>/throughput.{json,csv}
    python benchmarks/speed/bench_throughput.py --device cpu --tiny --out /tmp/tp.json

Imports neither jsonschema nor the lab's config: it runs on a machine that has only PyTorch and timm (on
CUDA, autocast is plain ``torch.autocast``; on CPU the lab's contract needs ``lab.run.train``, with a copy of
``autocast_for`` built from ``lab.numerics.contract`` when ``lab.run.train`` cannot be imported).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.models.presets import create_model  # noqa: E402
import lab.scaling  # noqa: E402
from lab.numerics.monitor import NumericsMonitor  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

#: full-size families (configs/imagenet.yaml) and their --tiny stand-ins (configs/default.yaml's presets)
FAMILIES = {
    "resnet50": {"task": "classify", "preset": "resnet50", "input": 224, "classes": 1000, "batch": 256,
                 "tiny": {"preset": "resnet50-digits", "input": 32, "classes": 10, "batch": 8}},
    "mobilenetv2": {"task": "classify", "preset": "mobilenetv2_100", "input": 224, "classes": 1000, "batch": 256,
                    "tiny": {"preset": "mobilenetv2-digits", "input": 32, "classes": 10, "batch": 8}},
    "vit": {"task": "classify", "preset": "vit_small_patch16", "input": 224, "classes": 1000, "batch": 256,
            "tiny": {"preset": "vit-tiny-digits", "input": 16, "classes": 10, "batch": 8}},
    "lm": {"task": "lm", "preset": "gpt2-small", "input": 1024, "classes": 50257, "batch": 16,
           "tiny": {"preset": "gpt-tiny", "input": 32, "classes": 512, "batch": 4}},
}
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
CONV_FAMILIES = ("resnet50", "mobilenetv2")

TARGET_FP16_OVER_FP32 = 2.6         # ResNet-50, FP16 (GradScaler) samples/s over true FP32
TARGET_SCALER_RATIO = 1.01          # lab dynamic scaler step time / torch.amp.GradScaler step time
NVIDIA_A100_AMP_OVER_TF32 = 2.63    # DeepLearningExamples ResNet-50 v1.5 PyTorch, 1x A100 80GB: 2470 / 938 img/s
SCALER_NAMES = {"torch": "torch.amp.GradScaler", "lab": "lab.scaling dynamic"}

CSV_FIELDS = ["family", "preset", "precision", "scaler", "status", "device", "batch", "input", "classes",
              "samples_per_s", "tokens_per_s", "ms_per_step", "peak_memory_mb", "scaler_time_ratio",
              "census_step_ratio",
              "channels_last", "compiled", "cudnn_benchmark", "rounds", "steps_per_round", "warmup_steps",
              "skipped_steps", "note"]


# --- precision settings ----------------------------------------------------------------------------------
def _autocast_for():
    """The lab's forward context of a precision (lab.numerics.precision needs no jsonschema, which the GPU machine
    lacks)."""
    from lab.numerics.precision import autocast_for
    return autocast_for, "lab.numerics.precision.autocast_for"


def set_tf32(on: bool) -> None:
    """TF32 in cuBLAS matmuls and cuDNN convolutions, on or off (off: what the lab's fp32 mode runs)."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    torch.set_float32_matmul_precision("high" if on else "highest")


def _torch_flags() -> dict:
    return {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_precision": torch.get_float32_matmul_precision(), "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "threads": torch.get_num_threads()}


def _restore_flags(flags: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    torch.set_float32_matmul_precision(flags["matmul_precision"])
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.set_num_threads(flags["threads"])


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the folder under results/reference/."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# --- one measurement -----------------------------------------------------------------------------------
class Trainer:
    """One model, optimizer and synthetic batch; `step()` is one training step at a precision."""

    def __init__(self, fam: dict, precision: str, dev: torch.device, args, autocast_for):
        self.fam, self.precision, self.dev = fam, precision, dev
        torch.manual_seed(0)
        model = create_model(fam["preset"], num_classes=fam["classes"], in_chans=0 if fam["task"] == "lm" else 3,
                             input_size=fam["input"])
        self.channels_last = bool(args.channels_last and fam["family"] in CONV_FAMILIES)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        self.model = model.to(dev, memory_format=fmt).train()
        self.params = sum(p.numel() for p in self.model.parameters())
        if fam["task"] == "lm":
            self.x = torch.randint(0, fam["classes"], (fam["batch"], fam["input"]), device=dev)
            self.y = torch.randint(0, fam["classes"], (fam["batch"], fam["input"]), device=dev)
        else:
            self.x = torch.randn(fam["batch"], 3, fam["input"], fam["input"], device=dev).contiguous(memory_format=fmt)
            self.y = torch.randint(0, fam["classes"], (fam["batch"],), device=dev)
        opt_name = args.optimizer or ("adamw" if fam["task"] == "lm" else "sgd")
        # a tiny learning rate: the weights hardly move, so every timed step does the same work
        if opt_name == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.05)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-6, momentum=0.9, weight_decay=1e-4)
        self.opt_name = opt_name
        self.forward = torch.compile(self.model) if args.compile else self.model
        amp = "bf16" if precision == "bf16" else "fp16" if precision == "fp16" else "fp32"
        self.autocast = lambda: autocast_for(amp, dev.type)

    def loss(self) -> torch.Tensor:
        """A step's start: gradients cleared, the forward and its loss under the precision's autocast."""
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            logits = self.forward(self.x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.y.reshape(-1))

    def step(self, scaler=None) -> None:
        loss = self.loss()
        if scaler is None:
            loss.backward()
            self.opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(self.opt)
            scaler.update()

    def census_block(self, n: int, scaler, monitor) -> float:
        """Seconds for n census steps: the step as the lab's loop runs one (lab/run/loop.py: begin_step before the
        forward, after_backward before the scaler's step, end_step after its update), every step a census step."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            monitor.begin_step(monitor.census_steps + 1, scaler.get_scale(), self.precision)
            scaler.scale(self.loss()).backward()
            monitor.after_backward()
            scaler.step(self.opt)
            scaler.update()
            monitor.end_step(scaler.last_found_inf)
        self.sync()
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def block(self, n: int, scaler=None) -> float:
        """Seconds for n steps, the device synchronised before and after."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step(scaler)
        self.sync()
        return time.perf_counter() - t0


def peak_memory_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _row(fam: dict, precision: str, dev, args, **kw) -> dict:
    row = {k: None for k in CSV_FIELDS}
    row.update(family=fam["family"], preset=fam["preset"], precision=precision, device=dev.type,
               batch=fam["batch"], input=fam["input"], classes=fam["classes"],
               channels_last=bool(args.channels_last and fam["family"] in CONV_FAMILIES),
               compiled=bool(args.compile),
               cudnn_benchmark=torch.backends.cudnn.benchmark if dev.type == "cuda" else None,
               rounds=args.rounds, steps_per_round=fam["steps"], warmup_steps=args.warmup, scaler="none")
    row.update(kw)
    return row


def _rates(fam: dict, seconds_per_step: float) -> dict:
    per_s = fam["batch"] / seconds_per_step
    out = {"samples_per_s": per_s, "ms_per_step": seconds_per_step * 1e3}
    if fam["task"] == "lm":
        out["tokens_per_s"] = per_s * fam["input"]
    return out


def measure(fam: dict, precision: str, dev: torch.device, args, autocast_for) -> list[dict]:
    """Rows for one (family, precision): one row, or two for fp16 (GradScaler, lab scaler)."""
    set_tf32(precision == "tf32")
    _free(dev)
    tr = Trainer(fam, precision, dev, args, autocast_for)
    n = fam["steps"]
    if precision != "fp16":
        tr.block(args.warmup)
        blocks = [tr.block(n) for _ in range(args.rounds)]
        med = statistics.median(blocks) / n
        row = _row(fam, precision, dev, args, status="ok", peak_memory_mb=peak_memory_mb(dev), skipped_steps=0,
                   **_rates(fam, med))
        row["_blocks_s"] = blocks
        return [row]

    # fp16: the same model, optimizer and batch under two scalers, blocks alternating A/B
    kw = dict(init_scale=args.init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=10**9)
    scalers = {"torch": torch.amp.GradScaler(dev.type, **kw),
               "lab": lab.scaling.create("dynamic", device=dev.type, **kw)}
    for s in scalers.values():
        tr.block(args.warmup, s)
    monitor = NumericsMonitor(tr.model, every=1)
    n_census = max(1, n // 2)
    tr.census_block(1, scalers["lab"], monitor)  # the first census step sets up its hooks' plans
    skipped_before = {"torch": _skipped(scalers["torch"], None), "lab": scalers["lab"].skipped_steps}
    times: dict[str, list[float]] = {"torch": [], "lab": []}
    census: list[float] = []
    for r in range(args.rounds):
        order = ("lab", "torch") if r % 2 == 0 else ("torch", "lab")
        for name in order:
            times[name].append(tr.block(n, scalers[name]))
        census.append(tr.census_block(n_census, scalers["lab"], monitor))
    monitor.close()
    ratios = [a / b for a, b in zip(times["lab"], times["torch"])]
    ratio = statistics.median(ratios)
    census_ratio = statistics.median((c / n_census) / (t / n) for c, t in zip(census, times["lab"]))
    peak = peak_memory_mb(dev)
    rows = []
    for name in ("torch", "lab"):
        med = statistics.median(times[name]) / n
        skipped = (scalers["lab"].skipped_steps - skipped_before["lab"] if name == "lab"
                   else _skipped(scalers["torch"], skipped_before["torch"]))
        row = _row(fam, precision, dev, args, scaler=SCALER_NAMES[name], status="ok", peak_memory_mb=peak,
                   scaler_time_ratio=ratio, skipped_steps=skipped,
                   census_step_ratio=census_ratio if name == "lab" else None,
                   note=("overflow in timed steps: skipped optimizer steps make this row faster" if skipped else None),
                   **_rates(fam, med))
        row["_blocks_s"] = times[name]
        row["_round_ratios"] = ratios
        rows.append(row)
    return rows


def _skipped(scaler: torch.amp.GradScaler, before):
    """GradScaler keeps no skip counter; its scale halves on every skipped step (growth never happens here)."""
    halvings = round(math.log2(scaler._init_scale / scaler.get_scale())) if scaler.get_scale() > 0 else 0
    return halvings if before is None else halvings - before


# --- report ----------------------------------------------------------------------------------------------
def summarise(rows: list[dict], dev) -> dict:
    """Ratios between precisions per family, the scaler overhead, and the targets."""
    rate = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        key = (r["family"], r["precision"])
        if r["precision"] != "fp16" or r["scaler"] == SCALER_NAMES["torch"]:
            rate[key] = r["samples_per_s"]
    families: dict[str, dict] = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        get = lambda p: rate.get((fam, p))  # noqa: E731
        ratio = lambda a, b: (get(a) / get(b)) if get(a) and get(b) else None  # noqa: E731
        fp16 = [r for r in rows if r["family"] == fam and r["precision"] == "fp16" and r["status"] == "ok"]
        families[fam] = {
            "fp16_over_fp32": ratio("fp16", "fp32"), "bf16_over_fp32": ratio("bf16", "fp32"),
            "tf32_over_fp32": ratio("tf32", "fp32"), "fp16_over_tf32": ratio("fp16", "tf32"),
            "bf16_over_fp16": ratio("bf16", "fp16"),
            "scaler_time_ratio_lab_over_torch": fp16[0]["scaler_time_ratio"] if fp16 else None,
            "scaler_round_ratios": fp16[0]["_round_ratios"] if fp16 else None,
            "census_step_over_step": next((r["census_step_ratio"] for r in fp16 if r.get("census_step_ratio")), None),
        }
    rn = families.get("resnet50", {})
    scaler_ratios = {f: v["scaler_time_ratio_lab_over_torch"] for f, v in families.items()
                     if v["scaler_time_ratio_lab_over_torch"] is not None}
    datacenter = dev.type == "cuda"
    targets = {
        "evaluated": datacenter,
        "note": None if datacenter else "targets are for a datacenter GPU; on CPU they are not evaluated",
        "resnet50_fp16_over_fp32": {"target_at_least": TARGET_FP16_OVER_FP32, "value": rn.get("fp16_over_fp32"),
                                    "met": (rn["fp16_over_fp32"] >= TARGET_FP16_OVER_FP32)
                                    if datacenter and rn.get("fp16_over_fp32") else None},
        "resnet50_fp16_over_tf32_vs_nvidia": {"nvidia_a100_amp_over_tf32": NVIDIA_A100_AMP_OVER_TF32,
                                              "value": rn.get("fp16_over_tf32")},
        "scaler_time_ratio": {"target_at_most": TARGET_SCALER_RATIO, "values": scaler_ratios,
                              "met": all(v <= TARGET_SCALER_RATIO for v in scaler_ratios.values())
                              if datacenter and scaler_ratios else None},
    }
    return {"families": families, "targets": targets}


def hardware(dev) -> dict:
    hw = {"cpu_model": files.cpu_name(), "machine": platform.machine(), "logical_cpus": os.cpu_count(),
          "torch_threads": torch.get_num_threads(), "gpu": None}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        hw.update(gpu=torch.cuda.get_device_name(dev), gpu_slug=gpu_slug(torch.cuda.get_device_name(dev)),
                  gpu_memory_gb=round(p.total_memory / 2**30, 1), compute_capability=f"{p.major}.{p.minor}",
                  sm_count=p.multi_processor_count)
    return hw


def software() -> dict:
    sw = {"torch": torch.__version__, "cuda": torch.version.cuda,
          "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
          "python": platform.python_version(), "platform": platform.platform()}
    try:
        import timm
        sw["timm"] = timm.__version__
    except ImportError:
        sw["timm"] = None
    return sw


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'family':12s} {'precision':9s} {'scaler':21s} {'batch':>5s} {'samples/s':>10s} {'tokens/s':>10s} "
          f"{'ms/step':>9s} {'peak MB':>9s}  status")
    for r in rows:
        num = lambda k, f: f.format(r[k]) if isinstance(r[k], (int, float)) else ""  # noqa: E731
        print(f"{r['family']:12s} {r['precision']:9s} {(r['scaler'] if r['scaler'] != 'none' else ''):21s} "
              f"{r['batch']:>5} {num('samples_per_s', '{:10.1f}'):>10s} {num('tokens_per_s', '{:10.0f}'):>10s} "
              f"{num('ms_per_step', '{:9.2f}'):>9s} {num('peak_memory_mb', '{:9.0f}'):>9s}  {r['status']}"
              + (f" ({r['note']})" if r["note"] else ""))
    for fam, s in summary["families"].items():
        parts = [f"{k} {v:.2f}x" for k, v in s.items() if k.endswith(("_fp32", "_tf32", "_fp16")) and v]
        if s["scaler_time_ratio_lab_over_torch"] is not None:
            parts.append(f"scaler lab/GradScaler {s['scaler_time_ratio_lab_over_torch']:.4f}")
        if s["census_step_over_step"] is not None:
            parts.append(f"census step / lab step {s['census_step_over_step']:.2f}")
        print(f"{fam:12s} " + ", ".join(parts))
    t = summary["targets"]
    if t["evaluated"]:
        rn = t["resnet50_fp16_over_fp32"]
        print(f"target ResNet-50 FP16/FP32 >= {rn['target_at_least']}: {rn['value']} -> {rn['met']}; "
              f"scaler ratio <= {t['scaler_time_ratio']['target_at_most']}: {t['scaler_time_ratio']['met']}")
    else:
        print(t["note"])


# --- main ------------------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--tiny", action="store_true",
                    help="small presets, inputs and batches, 1-2 timed steps (CPU smoke test)")
    ap.add_argument("--models", default=",".join(FAMILIES), help=f"comma-separated, from {', '.join(FAMILIES)}")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, from fp32, tf32, fp16, bf16")
    ap.add_argument("--batch", type=int, default=None, help="override every family's batch size")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per precision (and per scaler)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed blocks per precision (fp16: per scaler, alternating)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed block")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                    help="default: SGD with momentum for the image families (as NVIDIA and timm benchmark), "
                    "AdamW for the LM")
    ap.add_argument("--init-scale", type=float, default=2.0**16,
                    help="both scalers' initial scale (GradScaler's default)")
    ap.add_argument("--channels-last", action="store_true", help="channels_last memory format (convolutional families)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (compile time falls in the warm-up)")
    ap.add_argument("--no-cudnn-benchmark", action="store_true",
                    help="leave cuDNN autotuning off, as lab/run/train.py does")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    ap.add_argument("--strict", action="store_true",
                    help="stop at the first failed measurement instead of recording it")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new measurements after this many seconds (the rest are recorded as skipped)")
    ap.add_argument("--out", default=None, help="JSON file; the CSV goes beside it (default: "
                    "results/reference/<gpu>/throughput.json on CUDA, results/benchmarks/throughput_cpu.json on CPU)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    args.argv = argv
    dev, models, precisions = _resolve(args)
    out = Path(args.out)
    csv_path = out.with_suffix(".csv")
    saved = _torch_flags()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
        autocast_for, autocast_source = _autocast_for()
        args.started = files.now_iso()
        args.env = {"hardware": hardware(dev), "software": software(), "git": files.git_commit(REPO)}
        t_start = time.perf_counter()
        rows: list[dict] = []
        for name in models:
            fam = _family(name, args)
            for precision in precisions:
                skipped = _skip_reason(fam, precision, dev, args, time.perf_counter() - t_start)
                rows.extend([skipped] if skipped else _measure_one(fam, precision, dev, args, autocast_for))
                # after every measurement: a timeout keeps what was measured
                _write(out, csv_path, _report(rows, dev, args, autocast_source, time.perf_counter() - t_start), rows)
        report = _report(rows, dev, args, autocast_source, time.perf_counter() - t_start)
        _write(out, csv_path, report, rows)
    finally:
        _restore_flags(saved)
    print_table(rows, report["summary"])
    print(f"wrote {out} and {csv_path}")
    return report


def _resolve(args):
    """The device, models and precisions asked for (unknown names refused), and the defaults that depend on
    them: warm-up, rounds, output path."""
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [m for m in models if m not in FAMILIES] + [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown model or precision: {', '.join(bad)}; models: {', '.join(FAMILIES)}; "
                         f"precisions: {', '.join(PRECISIONS)}")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    if args.compile:  # compiling (and recompiling for the second scaler) must fall in the warm-up
        args.warmup = max(args.warmup, 3)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.tiny else 6)
    if args.out is None:
        args.out = (REPO / "results" / "reference" / gpu_slug(torch.cuda.get_device_name(dev)) / "throughput.json"
                    if dev.type == "cuda" else REPO / "results" / "benchmarks" / "throughput_cpu.json")
    return dev, models, precisions


def _family(name: str, args) -> dict:
    """One family's measurement settings: full size, or --tiny; --batch and --steps applied."""
    fam = dict(FAMILIES[name], family=name)
    if args.tiny:
        fam.update(fam.pop("tiny"))
    fam.pop("tiny", None)
    if args.batch:
        fam["batch"] = args.batch
    fam["steps"] = args.steps or (1 if args.tiny else (3 if fam["task"] == "lm" else 5))
    return fam


def _skip_reason(fam: dict, precision: str, dev, args, elapsed_s: float) -> dict | None:
    """The row of a measurement that is not made, or None."""
    if precision == "tf32" and dev.type != "cuda":
        return _row(fam, precision, dev, args, status="skipped", note="TF32 is a CUDA tensor-core mode")
    if args.budget_s is not None and elapsed_s > args.budget_s:
        return _row(fam, precision, dev, args, status="skipped", note=f"time budget of {args.budget_s:g} s spent")
    return None


def _measure_one(fam: dict, precision: str, dev, args, autocast_for) -> list[dict]:
    """The rows of one (family, precision) measurement; a failure is a row, so it does not lose the others."""
    try:
        return measure(fam, precision, dev, args, autocast_for)
    except torch.cuda.OutOfMemoryError as exc:
        return [_row(fam, precision, dev, args, status="oom", note=str(exc).splitlines()[0][:200])]
    except Exception as exc:  # a compile error, say
        if args.strict:
            raise
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return [_row(fam, precision, dev, args, status="error", note=f"{type(exc).__name__}: {first}")]
    finally:
        _free(dev)


def _report(rows, dev, args, autocast_source, wall_s) -> dict:
    argv = args.argv if args.argv is not None else sys.argv[1:]
    clean = [{k: v for k, v in r.items() if not k.startswith("_") or k == "_blocks_s"} for r in rows]
    for r in clean:
        r["blocks_s"] = r.pop("_blocks_s", None)
    return {
        "benchmark": "bench_throughput",
        "description": ("training throughput per family and precision on synthetic data of the real shape; "
                        "median over timed blocks; fp16 with torch.amp.GradScaler and the lab's dynamic scaler in "
                        "alternating blocks, scaler_time_ratio = median over rounds of lab/GradScaler block time"),
        "command": " ".join(["python", "benchmarks/speed/bench_throughput.py"] + list(argv)),
        "started": args.started,
        "wall_s": wall_s,
        "config": {"device": str(dev), "tiny": args.tiny, "warmup_steps": args.warmup, "rounds": args.rounds,
                   "channels_last": args.channels_last, "compile": args.compile,
                   "cudnn_benchmark": (not args.no_cudnn_benchmark) if dev.type == "cuda" else None,
                   "optimizer": args.optimizer or "sgd (images), adamw (lm)", "init_scale": args.init_scale,
                   "autocast": autocast_source, "budget_s": args.budget_s,
                   "peak_memory": ("torch.cuda.max_memory_allocated per precision" if dev.type == "cuda"
                                   else "process peak RSS (ru_maxrss), monotonic over the run")},
        **args.env,
        "rows": clean,
        "summary": summarise(rows, dev),
    }


def _write(out: Path, csv_path: Path, report: dict, rows: list[dict]) -> None:
    files.atomic_write_json(out, report)
    files.atomic_write_csv(csv_path, [{k: r.get(k, "") for k in CSV_FIELDS} for r in rows], CSV_FIELDS)


if __name__ == "__main__":
    main()

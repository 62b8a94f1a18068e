"""The CPU's tensor-core contract against CUDA's own FP16/BF16 kernels, in units in the last place.

The lab's op shapes, each in FP16 and BF16: a linear layer at inner sizes K (--sizes), ResNet-50's 3x3 and 1x1
convolutions, causal scaled-dot-product attention, layer norm, and cross-entropy over GPT-2's vocabulary from a
linear head. Inputs are drawn once (fixed seed, CPU generator) and rounded to the dtype; the reference is the op in
FP64 from those inputs, rounded to each way's output dtype. The ways: `contract_cpu` (the op as the lab runs it on a
CPU: lab.numerics.precision.autocast_for, i.e. CPU autocast + tensor_core_contract()) and, on CUDA, the op under
torch.autocast with cuBLAS's reduced-precision reductions off (the lab's setting) and on (torch's default), each
against the reference and against the contract. Per way: the share of outputs that differ, the largest difference
in ulps of the output's dtype (FP32 for layer_norm and cross_entropy: autocast runs them in FP32) and the largest
relative error (FP32 ulps of a reduction's output are not comparable across ops; relative errors are). Without a
GPU only the contract is measured (the rehearsal). The JSON is rewritten after each op, so a killed run keeps what
it measured.

    python benchmarks/gpu/contract_vs_cuda.py [--device cuda] [--sizes 64,1024,16384] --out results.json
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.numerics.precision import DTYPES, autocast_for  # noqa: E402

VOCAB = 50257  # GPT-2's


class Op(NamedTuple):
    name: str
    params: dict  # the shape, as recorded
    shapes: dict  # input name -> (shape, scale[, shift]); scale None: a class index
    fn: Callable  # fn(inputs: dict, dtype) -> output tensor


def _cross_entropy(t, dtype):
    logits = F.linear(t["h"], t["w"])
    if logits.dtype == torch.float64:
        # the reference: exact logits rounded once to the dtype, as every autocast device must store them; an
        # unrounded reference would put that inevitable rounding (~1e-4 of the loss) into every way alike
        logits = logits.to(dtype).double()
    return F.cross_entropy(logits, t["target"], reduction="none")


def ops(sizes: list[int]) -> list[Op]:
    """Scales ~1/sqrt(fan-in) keep outputs O(1) (logits as a trained LM's head gives them); the linear keeps its
    unit operands (a sweep over K)."""
    linear = [Op("linear", {"m": 64, "n": 64, "k": k}, {"x": ((64, k), 1.0), "w": ((64, k), 1.0)},
                 lambda t, dt: F.linear(t["x"], t["w"])) for k in sizes]
    conv = [Op(name, {"n": 8, "c_in": cin, "c_out": 64, "hw": 28, "kernel": ks},
               {"x": ((8, cin, 28, 28), 1.0), "w": ((64, cin, ks, ks), (cin * ks * ks) ** -0.5)},
               lambda t, dt, p=ks // 2: F.conv2d(t["x"], t["w"], padding=p))
            for name, cin, ks in (("conv3x3", 64, 3), ("conv1x1", 256, 1))]
    qkv = ((4, 4, 128, 64), 1.0)
    return linear + conv + [
        Op("attention", {"batch": 4, "heads": 4, "seq": 128, "head_dim": 64, "causal": True},
           {"q": qkv, "k": qkv, "v": qkv},
           lambda t, dt: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)),
        Op("layer_norm", {"rows": 4096, "dim": 768},
           {"x": ((4096, 768), 1.0), "w": ((768,), 0.1, 1.0), "b": ((768,), 0.1)},  # gain 1 + 0.1 N(0, 1)
           lambda t, dt: F.layer_norm(t["x"], (768,), t["w"], t["b"])),
        Op("cross_entropy", {"rows": 256, "hidden": 256, "vocab": VOCAB},
           {"h": ((256, 256), 1.0), "w": ((VOCAB, 256), 256 ** -0.5), "target": ((256,), None)}, _cross_entropy)]


def draw(op: Op, dtype: torch.dtype, seed: int = 0) -> dict:
    """FP32 tensors holding values of the dtype (as an FP32 model's weights under autocast: its cast is exact);
    a CPU generator, so CPU and CUDA ways read the same numbers."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, (shape, scale, *shift) in op.shapes.items():
        if scale is None:
            out[key] = torch.randint(0, VOCAB, shape, generator=g)
        else:
            out[key] = (torch.randn(shape, generator=g) * scale + sum(shift)).to(dtype).float()
    return out


def compute(op: Op, inputs: dict, device: str, context, dtype) -> torch.Tensor:
    """The op on `device` under `context` (an autocast): the one path every way takes, the rehearsal's too."""
    moved = {k: v.to(device) for k, v in inputs.items()}
    with context:
        out = op.fn(moved, dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # a kernel's error surfaces here, named, not at a later copy
    return out.detach().cpu()


def reference(op: Op, inputs: dict, dtype) -> torch.Tensor:
    """The op in FP64, unrounded: each way rounds it to its own output dtype when compared."""
    return op.fn({k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}, dtype)


def ordered(t: torch.Tensor) -> torch.Tensor:
    """A 16- or 32-bit float's bits as an integer that counts ulps: sign-magnitude to two's complement order, so
    +0 and -0 are both 0 and adjacent floats differ by 1, across zero too."""
    if t.element_size() == 2:
        bits, magnitude = t.contiguous().view(torch.int16).to(torch.int64), 0x7FFF
    else:
        bits, magnitude = t.contiguous().view(torch.int32).to(torch.int64), 0x7FFFFFFF
    return torch.where(bits < 0, -(bits & magnitude), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a.cpu()) - ordered(b.cpu())).abs()


def stats(out: torch.Tensor, other: torch.Tensor) -> dict:
    """`out` against `other` rounded to out's dtype (the reference's one rounding; exact for a wider contract)."""
    other = other.to(out.dtype)
    diff = ulps(out, other)
    a, b = out.double(), other.double()
    # relative to the smallest normal at least: finite (valid JSON) where the reference is 0
    rel = (a - b).abs() / b.abs().clamp(min=torch.finfo(out.dtype).tiny)
    return {"differ_share": float((diff > 0).double().mean()), "max_ulps": int(diff.max()),
            "max_rel": float(rel.max())}


@contextlib.contextmanager
def cuda_settings(dtype, reduced: bool):
    """cuBLAS's reduced-precision reduction for the dtype on or off, TF32 off for FP32 ops; all restored."""
    mm = torch.backends.cuda.matmul
    flag = f"allow_{'fp16' if dtype == torch.float16 else 'bf16'}_reduced_precision_reduction"
    saved = (getattr(mm, flag), getattr(mm, flag + "_split_k", None), mm.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        setattr(mm, flag, reduced)
        mm.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        # torch >= 2.10 keeps split-K beside the flag (a bare bool sets split-K on); older torch has the bool only
        setattr(mm, flag, saved[0] if saved[1] is None else (saved[0], saved[1]))
        mm.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


def native_ways(op: Op, name: str, device: str, inputs: dict, ref, contract) -> dict:
    """The op on `device` under its own autocast (torch.autocast on CUDA), reductions off then on. The flags are
    cuBLAS's: cuDNN's convolutions, the fused attention and the FP32 norms should not move with them; both are
    measured for every op, so that a dependence would show."""
    out = {}
    for reduced in (False, True):
        with cuda_settings(DTYPES[name], reduced):
            result = compute(op, inputs, device, autocast_for(name, device), DTYPES[name])
        way = f"cuda_reduced_reduction_{'on' if reduced else 'off'}"
        out[way] = stats(result, ref)
        out[way + "_vs_contract"] = stats(result, contract)
        if result.dtype != contract.dtype:
            out[way]["out_dtype"] = str(result.dtype).removeprefix("torch.")
    if op.name == "attention":  # which fused kernel torch picks is not recorded: each one, by name
        out.update(sdpa_backends(op, name, device, inputs, ref, contract))
    return out


SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sdpa_backends(op: Op, name: str, device: str, inputs: dict, ref, contract) -> dict:
    """The attention under each of SDPA's kernels (reductions off): `cuda_sdpa_<kernel>` and its `_vs_contract`, or
    `{"error": ...}` where the kernel does not take these inputs on this device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    for backend in SDPA_BACKENDS:
        way = f"cuda_sdpa_{backend.lower()}"
        try:
            with cuda_settings(DTYPES[name], False), sdpa_kernel(getattr(SDPBackend, backend)):
                result = compute(op, inputs, device, autocast_for(name, device), DTYPES[name])
        except (RuntimeError, AttributeError) as e:  # no kernel for these inputs here, or none of that name
            out[way] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            continue
        out[way], out[way + "_vs_contract"] = stats(result, ref), stats(result, contract)
    return out


def measure(op: Op, name: str, device: str) -> dict:
    dtype = DTYPES[name]
    inputs = draw(op, dtype)
    ref = reference(op, inputs, dtype)
    contract = compute(op, inputs, "cpu", autocast_for(name, "cpu"), dtype)
    record = {"op": op.name, **op.params, "out_dtype": str(contract.dtype).removeprefix("torch."),
              "contract_cpu": stats(contract, ref)}
    if device != "cpu":
        record.update(native_ways(op, name, device, inputs, ref, contract))
    return record


def table(report: dict) -> str:
    """One row per op and dtype, a column per way (share differing / max ulps): 20 lines for CUDA's 18 records,
    so gpu_check.sh's `tail -30` keeps all of it."""
    ways = [w for w in ("contract_cpu", "cuda_reduced_reduction_off", "cuda_reduced_reduction_on",
                        "cuda_reduced_reduction_off_vs_contract", "cuda_reduced_reduction_on_vs_contract")
            if any(w in r for rs in report["results"].values() for r in rs)]
    lines = ["| op | dtype | out | " + " | ".join(ways) + " |", "|---" * (3 + len(ways)) + "|"]
    for name, records in report["results"].items():
        for r in records:
            op = f"linear k={r['k']}" if r["op"] == "linear" else r["op"]
            cells = [f"{r[w]['differ_share']:.2%} / {r[w]['max_ulps']}" if w in r else "" for w in ways]
            lines.append(f"| {op} | {name} | {r['out_dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="64,1024,16384", help="the linear's inner sizes K (comma-separated)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "results": {name: [] for name in DTYPES}}
    for op in ops([int(v) for v in args.sizes.split(",")]):
        for name in DTYPES:
            report["results"][name].append(measure(op, name, args.device))
            files.atomic_write_json(out, report)  # a run killed at its limit keeps every finished op
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CPU's tensor-core contract against CUDA's own FP16/BF16 GEMMs, in units in the last place (issue 40).

For each inner size K, random operands are rounded to the dtype and multiplied three ways: exactly (FP64, rounded
once to the dtype: the reference), by the contract on the CPU (lab.numerics.contract: FP32 accumulation, one
rounding), and on CUDA with cuBLAS's reduced-precision reductions off (the lab's setting) and on (torch's default).
Reported per way: the share of results that differ from the reference, and the largest difference, in ulps of the
dtype. Where there is no GPU only the contract is measured (the rehearsal).

    python benchmarks/contract_vs_cuda.py [--device cuda] [--sizes 64,1024,16384] --out results.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab.numerics.contract import tensor_core_contract  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def ordered(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit float's bits as an integer that counts ulps (sign-magnitude to two's complement order)."""
    bits = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a.cpu()) - ordered(b.cpu())).abs()


def summary(diff: torch.Tensor) -> dict:
    return {"differ_share": float((diff > 0).float().mean()), "max_ulps": int(diff.max())}


def compare(k: int, dtype: torch.dtype, device: str, m: int = 64, n: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    reference = (x.double() @ w.double().T).to(dtype)
    with torch.autocast("cpu", dtype=dtype), tensor_core_contract():
        contract = F.linear(x.float(), w.float())
    out = {"k": k, "contract_cpu": summary(ulps(contract, reference))}
    if device == "cuda":
        flag = f"allow_{'fp16' if dtype == torch.float16 else 'bf16'}_reduced_precision_reduction"
        saved = getattr(torch.backends.cuda.matmul, flag)
        for on in (False, True):
            setattr(torch.backends.cuda.matmul, flag, on)
            cuda = F.linear(x.cuda(), w.cuda())
            torch.cuda.synchronize()
            out[f"cuda_reduced_reduction_{'on' if on else 'off'}"] = summary(ulps(cuda, reference))
            out[f"cuda_reduced_reduction_{'on' if on else 'off'}_vs_contract"] = summary(ulps(cuda, contract))
        setattr(torch.backends.cuda.matmul, flag, saved)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="64,1024,16384", help="inner sizes K (comma-separated)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",")]
    report = {"device": args.device, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "m": 64, "n": 64,
              "results": {name: [compare(k, dtype, args.device) for k in sizes] for name, dtype in DTYPES.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

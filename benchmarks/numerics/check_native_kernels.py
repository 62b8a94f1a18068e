"""Does this CPU's own FP16/BF16 kernels meet the tensor-core contract? (lab.numerics.contract_reference decides.)

For each case of tests/test_fp16_cpu.py's shapes (convolutions, linear, matmul, attention), the op runs
under plain CPU autocast (PyTorch's native reduced-precision kernels) and under lab.numerics.contract's contract,
and each output and gradient is checked against the FP64 reference rounded once, within the FP32
accumulation bound. The native answer depends on the CPU; the contract's must not. Writes a JSON report.

    python benchmarks/numerics/check_native_kernels.py [--out results/benchmarks/native_kernels.json]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.numerics.contract_reference import (BF16, FP16, assert_within_contract, attention_reference,  # noqa: E402
                                             check_bilinear, mixed)
from lab.numerics.contract import tensor_core_contract  # noqa: E402

CASES = [  # (name, op, operand shapes, kwargs)
    ("conv2d 3x3", F.conv2d, [(8, 8, 10, 10), (16, 8, 3, 3), (16,)], dict(padding=1)),
    ("conv2d depthwise s2", F.conv2d, [(8, 16, 10, 10), (16, 1, 3, 3), (16,)], dict(stride=2, padding=1,
                                                                                     groups=16)),
    ("conv2d 1x1", F.conv2d, [(8, 32, 6, 6), (24, 32, 1, 1), (24,)], {}),
    ("conv2d patch 4x4 s4", F.conv2d, [(4, 3, 16, 16), (8, 3, 4, 4), (8,)], dict(stride=4)),
    ("conv_transpose2d", F.conv_transpose2d, [(4, 8, 6, 6), (8, 4, 3, 3), (4,)],
     dict(stride=2, padding=1, output_padding=1)),
    ("linear", F.linear, [(4, 6, 64), (24, 64), (24,)], {}),
    ("matmul", torch.matmul, [(4, 8, 48), (48, 8)], {}),
]


def run(fn, operands, cotangent, dtype, contract):
    leaves = [t.detach().clone().requires_grad_() for t in operands]
    with torch.autocast("cpu", dtype=dtype), (tensor_core_contract() if contract else contextlib.nullcontext()):
        out = fn(*leaves)
    out.backward(cotangent)
    return out, [t.grad for t in leaves]


def verdict(check) -> str:
    try:
        check()
        return "within contract"
    except AssertionError as err:
        return str(err).split(";")[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/benchmarks/native_kernels.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    cpu = files.cpu_info()
    print(f"CPU {cpu['model']}: FP16 arithmetic {cpu['fp16_arithmetic'] or 'none'}, "
          f"BF16 arithmetic {cpu['bf16_arithmetic'] or 'none'}, torch {cpu['torch_cpu_capability']}")
    rows = []
    for dtype in (FP16, BF16):
        for i, (name, op, shapes, kwargs) in enumerate(CASES):
            operands = [mixed(*s, dtype=dtype, seed=i * 10 + j) for j, s in enumerate(shapes)]
            fn = lambda *t, op=op, kwargs=kwargs: op(*t, **kwargs)  # noqa: E731
            with torch.no_grad():
                shape = fn(*[t.double() for t in operands]).shape
            g = mixed(*shape, dtype=dtype, seed=i + 77)
            row = {"op": name, "dtype": str(dtype).removeprefix("torch.")}
            for path in ("native", "contract"):
                out, grads = run(fn, operands, g, dtype, contract=path == "contract")
                row[path] = verdict(lambda: check_bilinear(fn, operands, out, grads, g, dtype, name))
            rows.append(row)
        q, k, v, do = (mixed(2, 3, 17, 16, dtype=dtype, seed=s).mul(0.5).to(dtype) for s in range(4))
        ref = attention_reference(q, k, v, do)
        row = {"op": "attention", "dtype": str(dtype).removeprefix("torch.")}
        for path in ("native", "contract"):
            out, (dq, dk, dv) = run(F.scaled_dot_product_attention, [q, k, v], do, dtype, path == "contract")
            row[path] = verdict(lambda: [assert_within_contract(t, *ref[n], dtype, f"attention {n}")
                                         for n, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))])
        rows.append(row)
    for r in rows:
        print(f"{r['dtype']:9s} {r['op']:20s} native: {r['native'][:90]:90s} contract: {r['contract'][:40]}")
    files.atomic_write_json(args.out, {"benchmark": "native CPU kernels against the tensor-core contract",
                                       "cpu": cpu, "versions": files.package_versions(), "time": files.now_iso(),
                                       "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

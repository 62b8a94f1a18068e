"""Mutation check: each mutant of lab/numerics/contract.py that breaks the tensor-core contract fails the fidelity
tests.

A mutant is one textual change to the module (a second rounding, no final rounding, a low-precision
accumulation), applied in a temporary copy of the package; tests/test_fp16_cpu.py then runs against it and
must fail. The unmutated copy must pass, so a failure means the mutant was caught, not that the copy broke.
"""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

MUTANTS = {
    "linear output rounded twice (via bf16)": (
        "return F.linear(x.float(), weight.float(), _widen(bias)).to(x.dtype)",
        "return F.linear(x.float(), weight.float(), _widen(bias)).to(torch.bfloat16).to(x.dtype)", "linear"),
    "linear output not rounded": (
        "return F.linear(x.float(), weight.float(), _widen(bias)).to(x.dtype)",
        "return F.linear(x.float(), weight.float(), _widen(bias))", "linear"),
    "linear input gradient rounded twice": (
        "gx = (g @ weight.float()).reshape(x.shape).to(x.dtype)",
        "gx = (g @ weight.float()).reshape(x.shape).to(torch.bfloat16).to(x.dtype)", "linear"),
    "matmul partial products rounded before the broadcast sum": (
        "gb = _sum_to(a.float().transpose(-2, -1) @ g_ab, b.shape).to(a.dtype)",
        "gb = _sum_to((a.float().transpose(-2, -1) @ g_ab).to(a.dtype).float(), b.shape).to(a.dtype)", "matmul"),
    "convolution gradients rounded twice": (
        "return *(_round(g, x.dtype) for g in grads), None",
        "return *(_round(_round(g, torch.bfloat16 if x.dtype == torch.float16 else torch.float16), x.dtype)"
        " for g in grads), None", "convolution"),
    "convolution output rounded twice": (
        "out = torch.ops.aten.convolution(x.float(), weight.float(), _widen(bias), *conf)",
        "out = torch.ops.aten.convolution(x.float(), weight.float(), _widen(bias), *conf).to(torch.bfloat16 "
        "if x.dtype == torch.float16 else torch.float16).float()", "convolution"),
    "attention output rounded twice": (
        "out = _flash(q32, k32, v32, mask, is_causal, scale)[0]",
        "out = _flash(q32, k32, v32, mask, is_causal, scale)[0].to(q.dtype).float().to(torch.bfloat16).float()",
        "attention"),
    "attention backward from the rounded output (a GPU flash kernel's row term)": (
        "do, q32, k32, v32, out, lse, 0.0", "do, q32, k32, v32, out.to(q.dtype).float(), lse, 0.0", "attention"),
    "attention probabilities rounded before P @ V (dropout path)": (
        "out = probs @ v32", "out = probs.to(q.dtype).float() @ v32", "attention and dropout"),
    "max_pool backward summed in low precision": (
        "gx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out.float(), x.float(), *ctx.conf, idx)",
        "gx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out, x, *ctx.conf, idx)", "max_pool"),
}


def run_fidelity(root, selection) -> subprocess.CompletedProcess:
    # -n 0: the copied pyproject.toml asks for pytest-xdist's workers; one process reports the failure plainly
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k",
                           selection, "tests/test_fp16_cpu.py"], cwd=root, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutant")
    for name in ("lab", "tests", "configs"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_unmutated_copy_passes(package_copy):
    done = run_fidelity(package_copy, "linear or matmul or convolution or attention or max_pool")
    assert done.returncode == 0, done.stdout[-2000:]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(package_copy, name):
    old, new, selection = MUTANTS[name]
    module = package_copy / "lab" / "numerics" / "contract.py"
    original = (REPO / "lab" / "numerics" / "contract.py").read_text()
    assert original.count(old) == 1, f"mutant {name!r} no longer matches lab/numerics/contract.py"
    module.write_text(original.replace(old, new))
    try:
        done = run_fidelity(package_copy, selection)
    finally:
        module.write_text(original)
    assert done.returncode == 1 and "AssertionError" in done.stdout + done.stderr, (
        f"mutant survived: {name}\n{done.stdout[-2000:]}")

"""Mutation check: each mutant of lab/numerics/contract.py that breaks the tensor-core contract fails the fidelity
tests.

A mutant is one textual change to the module (a second rounding, no final rounding, a low-precision
accumulation). The mutated text is compiled into a module of its own, which stands in for lab.numerics.contract
(sys.modules) while a copy of tests/test_fp16_cpu.py runs against it in this process (pytester; a subprocess per
mutant cost ~8 s of start-up and imports for ~1 s of tests) and must fail with an AssertionError from a fidelity
check. The unmutated text, compiled the same way, must pass: a failure means the mutant was caught, not that the
stand-in broke.
"""
import sys
import types

import pytest
import torch._dynamo  # noqa: F401

from conftest import REPO

pytest_plugins = ["pytester"]
# pytester drops, after each in-process run, every module that the run imported. torch imports torch._dynamo lazily
# (the FP64 attention reference's vjp does), and torch._dynamo imports a module that registers a torch library:
# imported a second time, in a later run, that registration fails. Imported here, before any run, it stays.

CONTRACT = REPO / "lab" / "numerics" / "contract.py"

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
        "out, lse = _flash(q32, k32, v32, mask, is_causal, scale)[:2]",
        "out, lse = _flash(q32, k32, v32, mask, is_causal, scale)[:2]; "
        "out = out.to(q.dtype).float().to(torch.bfloat16).float()",
        "attention"),
    "attention backward from the rounded output (a GPU flash kernel's row term)": (
        "do, q32, k32, v32, out, lse, 0.0", "do, q32, k32, v32, out.to(q.dtype).float(), lse, 0.0", "attention"),
    "attention probabilities rounded before P @ V (dropout path)": (
        "out = probs @ v32", "out = probs.to(q.dtype).float() @ v32", "attention and dropout"),
    "max_pool backward summed in low precision": (
        "gx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out.float(), x.float(), *ctx.conf, idx)",
        "gx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out, x, *ctx.conf, idx)", "max_pool"),
}


def contract_module(text: str) -> types.ModuleType:
    """lab.numerics.contract built from ``text`` (the file's own, or a mutant's)."""
    module = types.ModuleType("lab.numerics.contract")
    module.__file__, module.__package__ = str(CONTRACT), "lab.numerics"
    exec(compile(text, str(CONTRACT), "exec"), module.__dict__)
    return module


def run_fidelity(pytester, monkeypatch, text, selection):
    """tests/test_fp16_cpu.py's tests chosen by ``selection``, their CPU-autocast cases (the mutants live in code
    that the stored-FP16 cases share: one mode catches them), against the contract built from ``text``. The copy
    has its own module name: the suite may already have imported tests/test_fp16_cpu.py as test_fp16_cpu."""
    monkeypatch.setitem(sys.modules, "lab.numerics.contract", contract_module(text))
    pytester.makepyfile(test_fp16_cpu_copy=(REPO / "tests" / "test_fp16_cpu.py").read_text())
    return pytester.inline_run("-x", "-p", "no:xdist", "-p", "no:cacheprovider", "-k",
                               f"({selection}) and not stored-low-precision", "test_fp16_cpu_copy.py")


def test_unmutated_copy_passes(pytester, monkeypatch):
    rec = run_fidelity(pytester, monkeypatch, CONTRACT.read_text(),
                       "linear or matmul or convolution or attention or max_pool")
    passed, _, failed = rec.listoutcomes()
    assert rec.ret == 0 and not failed and len(passed) > 50, (rec.ret, [r.longreprtext[-2000:] for r in failed])


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(pytester, monkeypatch, name):
    old, new, selection = MUTANTS[name]
    original = CONTRACT.read_text()
    assert original.count(old) == 1, f"mutant {name!r} no longer matches lab/numerics/contract.py"
    rec = run_fidelity(pytester, monkeypatch, original.replace(old, new), selection)
    failed = rec.getfailures()  # collection errors included: only a failing fidelity check counts
    assert rec.ret == 1 and failed, f"mutant survived: {name} (exit {rec.ret})"
    for report in failed:
        assert report.when == "call" and report.longrepr.reprcrash.message.startswith("AssertionError"), (
            f"mutant {name!r} failed otherwise than by a fidelity check:\n{report.longreprtext[-2000:]}")

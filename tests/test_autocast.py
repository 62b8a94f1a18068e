"""lab.autocast(device, dtype): the public FP16/BF16 forward context (lab/numerics/precision.py, docs/api.md).

On a CPU it is torch.autocast plus the tensor-core contract: a Linear's output (and each gradient) is the exact
result of the FP16-rounded operands, rounded once to FP16. The operands are chosen so that this is a statement of
mathematics: small multiples of powers of two, whose products and sums FP32 holds exactly, while their sums have
more significant bits than FP16 (or BF16) holds, so the one rounding is a real one. The FP64 reference is then the
exact value, and the contract's output must equal it rounded once. Also: FP32 and enabled=False switch autocast
off inside, bad input is refused with what is accepted, and lab.run.parts (split into modules named for what
they hold) still imports, with a DeprecationWarning.
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import lab
from lab.numerics import precision

from conftest import REPO, count_contract_calls

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
K = 256  # the reduction length


def operands(seed: int = 0):
    """x (4, 8, K), a Linear(K, 32)'s weight and bias, and an upstream gradient: integers times powers of two, of
    seven significant bits (x, the gradient) or three (weight, bias), exact in FP16 and BF16; x32 is x with a
    relative 2**-13 added, which rounding to FP16 or BF16 removes again (the operands must be rounded first). A
    product x w is a multiple of 2**-11, a sum of K of them plus the bias below 2**18 of those steps: exact in FP32
    (24 bits), beyond FP16 (11) and BF16 (8), so that rounding the product before adding the bias (twice) differs
    from rounding once. The gradients' sums likewise."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda n, *shape: torch.randint(-n, n + 1, shape, generator=g).float()  # noqa: E731
    x = ints(127, 4, 8, K) / 128
    w, b = ints(7, 32, K) / 16, ints(7, 32) / 1024
    grad = ints(127, 4, 8, 32) / 64
    return x * (1 + 2.0**-13), x, w, b, grad


def linear(w, b):
    lin = torch.nn.Linear(K, 32)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin


def rounded_once(exact64: torch.Tensor, dtype) -> torch.Tensor:
    """The exact value (FP64 holds it) rounded once to ``dtype``; and the test is void unless some outputs round."""
    out = exact64.to(dtype)
    assert (out.double() != exact64).any(), "no output needed rounding: the test would not see a second one"
    return out


# --- the public name ----------------------------------------------------------------------------------------
def test_lab_autocast_is_public():
    assert "autocast" in lab.__all__ and "autocast" in dir(lab)
    assert lab.autocast is precision.autocast


# --- the contract, against mathematics ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("spelling", ["dtype", "string"])
def test_a_linear_is_the_exact_result_of_rounded_operands_rounded_once(monkeypatch, name, spelling):
    dtype = LOW[name]
    x32, x, w, b, _ = operands()
    lin = linear(w, b)
    calls = count_contract_calls(monkeypatch)
    with lab.autocast("cpu", dtype if spelling == "dtype" else name):
        out = lin(x32)
    exact = x.double() @ w.double().T + b.double()  # x32 rounded to FP16/BF16 is x; w, b, x are exact there
    assert out.dtype == dtype
    assert torch.equal(out, rounded_once(exact, dtype))
    assert calls.get(F.linear) == 1  # computed by the contract, not by the CPU's own FP16 kernel


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_each_gradient_is_the_exact_result_rounded_once(name, backward_inside):
    """Also with .backward() called inside the region: the contract switches autocast off for its own forward and
    backward calls and must hand the region back with autocast on, in its dtype."""
    dtype = LOW[name]
    _, x, w, b, grad = operands(1)
    lin = linear(w, b)
    x = x.clone().requires_grad_()
    with lab.autocast("cpu", dtype):
        out = lin(x)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
        if backward_inside:
            out.backward(grad.to(dtype))
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    assert not torch.is_autocast_enabled("cpu")
    if not backward_inside:
        out.backward(grad.to(dtype))
    g, x64, w64 = grad.double().reshape(-1, 32), x.detach().double().reshape(-1, K), w.double()
    assert torch.equal(x.grad, rounded_once(g @ w64, dtype).float().reshape(x.shape))  # to FP32 through the cast
    assert torch.equal(lin.weight.grad, rounded_once(g.T @ x64, dtype).float())
    assert torch.equal(lin.bias.grad, g.sum(0).to(dtype).float())


def test_fp32_and_disabled_are_autocast_off_inside(monkeypatch):
    x32, _, w, b, _ = operands()
    lin = linear(w, b)
    reference = F.linear(x32, lin.weight, lin.bias)  # FP32, no autocast
    calls = count_contract_calls(monkeypatch)
    for ctx in (lab.autocast("cpu", torch.float32), lab.autocast("cpu", "fp32"),
                lab.autocast("cpu", torch.float16, enabled=False)):
        with lab.autocast("cpu", torch.float16), warnings.catch_warnings():  # an enclosing FP16 region: off inside
            warnings.simplefilter("error")  # and without torch's warning about FP32 as an autocast dtype
            with ctx:
                out = lin(x32)
                assert not torch.is_autocast_enabled("cpu")
            assert torch.is_autocast_enabled("cpu")
        assert out.dtype == torch.float32 and torch.equal(out, reference), ctx
    assert calls == {}


def test_the_same_object_enters_again_nests_and_decorates():
    x32, _, w, b, _ = operands()
    lin = linear(w, b)
    ctx = lab.autocast("cpu", torch.float16)
    with ctx:
        with ctx:
            assert lin(x32).dtype == torch.float16
        assert lin(x32).dtype == torch.float16
    assert lin(x32).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with ctx:
        assert lin(x32).dtype == torch.float16

    @lab.autocast("cpu", "bf16")
    def forward(t):
        return lin(t)
    assert forward(x32).dtype == torch.bfloat16 and lin(x32).dtype == torch.float32


def test_the_recorders_fp32_replay_switches_it_off():
    """lab.record replays a user's step under autocast_off: a lab.autocast region inside computes in FP32."""
    x32, _, w, b, _ = operands()
    lin = linear(w, b)
    with precision.autocast_off():
        with lab.autocast("cpu", torch.float16):
            out = lin(x32)
    assert out.dtype == torch.float32 and torch.equal(out, F.linear(x32, lin.weight, lin.bias))


def test_cuda_is_torch_autocast_without_the_contract():
    ctx = lab.autocast(torch.device("cuda", 0), torch.float16)
    assert (ctx.device, ctx.dtype, ctx.enabled) == ("cuda", torch.float16, True)
    assert lab.autocast("cuda:1", "bf16").device == "cuda"
    if not torch.cuda.is_available():
        return
    x = torch.randn(4, K, device="cuda")
    w = torch.randn(32, K, device="cuda")
    with ctx:
        assert F.linear(x, w).dtype == torch.float16
        assert torch.overrides._get_current_function_mode_stack() == []  # nothing rerouted on a GPU


# --- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["mps", "tpu", "", None, 0, "cpu:x"])
def test_an_unknown_device_is_refused_naming_the_accepted_ones(device):
    with pytest.raises(ValueError, match=re.escape("device: expected 'cpu' or 'cuda'") + ".*" + re.escape(
            f"found {device!r}")):
        lab.autocast(device, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn, "fp8", "float16", "FP16", None,
                                   16])
def test_an_unknown_dtype_is_refused_naming_the_accepted_ones(dtype):
    with pytest.raises(ValueError, match=re.escape("dtype: expected torch.float16, torch.bfloat16 or torch.float32, "
                                                   "or one of 'fp16', 'bf16', 'fp32'; found")):
        lab.autocast("cpu", dtype)


# --- the split of lab.run.parts -----------------------------------------------------------------------------
def test_the_old_module_still_imports_and_warns(monkeypatch):
    monkeypatch.delitem(sys.modules, "lab.run.parts", raising=False)
    with pytest.warns(DeprecationWarning, match=r"lab\.run\.parts is deprecated and goes in the next release: "
                                                r"import from lab\.numerics\.precision"):
        from lab.run.parts import autocast_for  # noqa: F401
    parts = sys.modules["lab.run.parts"]
    from lab.run import evaluation, memory, optim, process
    assert parts.autocast_for is precision.autocast_for and parts.autocast_off is precision.autocast_off
    new = {name: getattr(m, name) for m in (precision, evaluation, memory, optim, process) for name in dir(m)}
    for name in parts.__all__:
        assert getattr(parts, name) is new[name], name


def test_the_repo_no_longer_imports_the_old_module():
    """Its own code, tests, benchmarks and workflow import the new modules (the shim goes in the next release)."""
    old = re.compile(r"^\s*(from lab\.run\.parts import|import lab\.run\.parts|from lab\.run import [^\n]*\bparts\b)",
                     re.M)
    users = [str(p.relative_to(REPO)) for folder in ("lab", "tests", "benchmarks", "workflow")
             for p in sorted((REPO / folder).rglob("*")) if p.suffix in (".py", ".smk") or p.name == "Snakefile"
             if p.is_file() and p.name != "test_autocast.py" and old.search(p.read_text())]
    assert users == []
    code = ("import sys, lab.cli, lab.run.train, lab.run.record, lab.run.sizing, lab.run.sharding; "
            "print('lab.run.parts' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

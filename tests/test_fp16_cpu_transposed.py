"""conv_transpose1d and conv_transpose3d (and conv1d/conv3d with string padding), which docs/fp16-cpu.md lists as
rerouted under the tensor-core contract, checked like tests/test_fp16_cpu.py checks conv_transpose2d: forward
and every gradient against the FP64 result on the same operands rounded once, and the contract's convolution
(lab.numerics.contract._Convolution) counted, so that an op left to the CPU's own kernel fails even where that
kernel happens to land within the bound.
"""
import pytest
import torch
import torch.nn.functional as F

from lab.numerics import contract
from lab.numerics.contract_reference import BF16, FP16, check_bilinear, mixed

CASES = [  # (op, x shape, weight shape, kwargs, spatial dims); transposed weights are (in, out / groups, *k)
    ("conv_transpose1d", (4, 8, 12), (8, 4, 3), dict(stride=2, padding=1, output_padding=1), 1),
    ("conv_transpose1d", (4, 6, 10), (6, 2, 5), dict(stride=3, padding=2, groups=2, dilation=2), 1),
    ("conv_transpose1d", (6, 12), (6, 4, 3), dict(stride=2), 1),                        # unbatched
    ("conv_transpose3d", (2, 4, 4, 5, 5), (4, 3, 3, 3, 3), dict(stride=2, padding=1, output_padding=1), 3),
    ("conv_transpose3d", (2, 4, 3, 4, 4), (4, 2, 2, 3, 3), dict(stride=(1, 2, 2), groups=2), 3),
    ("conv1d", (4, 6, 20), (8, 6, 4), dict(padding="same", dilation=2), 1),              # string padding
    ("conv3d", (4, 3, 5, 6, 6), (4, 3, 3, 3, 3), dict(padding="same"), 3),
    ("conv1d", (4, 6, 21), (8, 6, 5), dict(padding="valid", stride=2), 1),
]


def run_contract(fn, operands, cotangent, dtype):
    """fn on leaf copies of the operands under CPU autocast + the contract; output and operand grads."""
    leaves = [t.detach().clone().requires_grad_() for t in operands]
    with torch.autocast("cpu", dtype=dtype), contract.tensor_core_contract():
        out = fn(*leaves)
    out.backward(cotangent)
    return out, [t.grad for t in leaves]


@pytest.fixture
def calls(monkeypatch):
    """Every call of the contract's convolution: (transposed, batched input's spatial dims)."""
    seen = []
    real = contract._Convolution.apply

    def counting(x, weight, bias, conf):
        seen.append((conf[3], x.dim() - 2))
        return real(x, weight, bias, conf)

    monkeypatch.setattr(contract._Convolution, "apply", counting)
    return seen


@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_rerouted_forward_and_gradients(case, dtype, calls):
    op, xs, ws, kwargs, dims = CASES[case]
    fn = getattr(F, op)
    transposed = op.startswith("conv_transpose")
    x, w = mixed(*xs, dtype=dtype, seed=case), mixed(*ws, dtype=dtype, seed=case + 50)
    out_channels = ws[1] * kwargs.get("groups", 1) if transposed else ws[0]
    bias = mixed(out_channels, dtype=dtype, seed=case + 99)
    with torch.no_grad():
        shape = fn(x.double(), w.double(), bias.double(), **kwargs).shape
    g = mixed(*shape, dtype=dtype, seed=case + 7)
    out, grads = run_contract(lambda a, b, c: fn(a, b, c, **kwargs), [x, w, bias], g, dtype)
    assert calls == [(transposed, dims)], f"{op} did not go through the contract: {calls}"
    assert out.dtype == dtype and out.shape == shape
    report = check_bilinear(lambda a, b, c: fn(a, b, c, **kwargs), [x, w, bias], out, grads, g, dtype, op)
    assert set(report) == {"output", "grad0", "grad1", "grad2"}
    assert report["output"]["must_be_exact"] > 0.9 * report["output"]["elements"]


def test_fp32_operands_are_rerouted_too_and_float64_is_not(calls):
    x, w = torch.randn(2, 4, 6), torch.randn(4, 3, 3)
    with torch.autocast("cpu", dtype=FP16), contract.tensor_core_contract():
        out = F.conv_transpose1d(x, w, stride=2)
        assert out.dtype == FP16 and calls == [(True, 1)]
        F.conv_transpose3d(x.double()[..., None, None], w.double()[..., None, None])   # FP64: left alone
    assert calls == [(True, 1)]

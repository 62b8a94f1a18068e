"""lab.numerics.contract computes the tensor-core contract on CPU: checked against mathematics, never against a CPU
kernel.

Every rerouted op, forward and each gradient, on FP16/BF16 operands that include cancellation, subnormals
(near 2^-24), the normal boundary (2^-14), values near 65504, non-contiguous and channels-last layouts, is
compared with the FP64 result on the same operands rounded once (lab/numerics/contract_reference.py): it must be
that value wherever FP32 accumulation cannot move it across a rounding boundary, and within the FP32
accumulation bound elsewhere. Mutants (FP16 accumulation, a second rounding, no final rounding, no operand
rounding) must fail the same checks.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.numerics.contract_reference import (assert_within_contract, attention_reference, check_bilinear, fp32_bound,
                                             BF16, FP16, MAX16, SUB16, U32, mixed, round_to)
from lab.numerics.contract import FP16_PATH_CONTRACT, tensor_core_contract  # noqa: F401



def run_contract(fn, operands, cotangent, dtype, autocast=True):
    """fn on leaf copies of the operands under CPU autocast + the contract (``autocast=False``: the contract alone,
    on operands stored in the low-precision dtype, as in a ``.half()`` model); output and operand grads."""
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in operands]
    with torch.autocast("cpu", dtype=dtype, enabled=autocast), tensor_core_contract():
        out = fn(*leaves)
    out.backward(cotangent)
    return out, [t.grad if t.is_floating_point() else None for t in leaves]


# --- the reference itself --------------------------------------------------------------------------------
def test_round_to_is_one_correct_rounding():
    import numpy as np
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-30, 18, (20000,),
                                                                                             generator=g))
    # numpy converts float64 to float16 directly, with one rounding
    with np.errstate(over="ignore"):  # values past 65520 become inf, as they should
        expected = torch.from_numpy(x.numpy().astype(np.float16).astype(np.float64))
    assert torch.equal(round_to(x, FP16), expected)
    # values that FP32 represents: torch's float32 -> bfloat16 is one correct rounding
    x32 = x.float().double()
    assert torch.equal(round_to(x32, BF16), x32.float().to(BF16).double())
    # a double rounding (via FP32) would get this one wrong: 1 + 2^-11 + 2^-40 rounds up to 1 + 2^-10
    assert float(round_to(torch.tensor(1 + 2 ** -11 + 2 ** -40, dtype=torch.float64), FP16)) == 1 + 2 ** -10
    edges = torch.tensor([2 ** -25, 2 ** -25 * 1.0001, 65519.99, 65520.0, -65520.0], dtype=torch.float64)
    assert round_to(edges, FP16).tolist() == [0.0, SUB16, MAX16, float("inf"), float("-inf")]


# --- convolution ------------------------------------------------------------------------------------------
CONVS = [  # (op, x shape, weight shape, kwargs)
    ("conv2d", (8, 8, 10, 10), (16, 8, 3, 3), dict(padding=1)),                 # plain 3x3, with bias
    ("conv2d", (8, 16, 10, 10), (16, 1, 3, 3), dict(stride=2, padding=1, groups=16)),  # depthwise (MobileNet)
    ("conv2d", (8, 32, 6, 6), (24, 32, 1, 1), {}),                              # pointwise (bottleneck)
    ("conv2d", (4, 6, 12, 12), (12, 3, 5, 5), dict(stride=2, padding=2, groups=2)),
    ("conv2d", (4, 3, 16, 16), (8, 3, 4, 4), dict(stride=4)),                   # patch embedding (ViT)
    ("conv2d", (4, 4, 9, 9), (6, 4, 4, 4), dict(padding="same", dilation=1)),   # 'same' with an even kernel
    ("conv1d", (4, 6, 20), (8, 6, 5), dict(padding=2)),
    ("conv3d", (4, 3, 5, 6, 6), (4, 3, 3, 3, 3), dict(padding=1)),
    ("conv_transpose2d", (4, 8, 6, 6), (8, 4, 3, 3), dict(stride=2, padding=1, output_padding=1)),
]


STORED = pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "stored-low-precision"])


@STORED
@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("case", range(len(CONVS)))
def test_convolution_forward_and_gradients(case, dtype, autocast):
    op, xs, ws, kwargs = CONVS[case]
    fn = getattr(F, op)
    x, w = mixed(*xs, dtype=dtype, seed=case), mixed(*ws, dtype=dtype, seed=case + 50)
    bias = mixed(ws[1] if op.startswith("conv_transpose") else ws[0], dtype=dtype, seed=case + 99)
    if op == "conv2d" and case == 0:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        shape = fn(x.double(), w.double(), bias.double(), **kwargs).shape
    g = mixed(*shape, dtype=dtype, seed=case + 7)
    out, grads = run_contract(lambda a, b, c: fn(a, b, c, **kwargs), [x, w, bias], g, dtype, autocast)
    report = check_bilinear(lambda a, b, c: fn(a, b, c, **kwargs), [x, w, bias], out, grads, g, dtype, op)
    # the check has teeth: most elements are pinned to the correctly rounded value
    assert report["output"]["must_be_exact"] > 0.9 * report["output"]["elements"]


def test_channels_last_and_strided_views_stay_exact():
    x = mixed(8, 8, 10, 10, seed=3).contiguous(memory_format=torch.channels_last)
    w = mixed(16, 8, 3, 3, seed=4)[:, :, :, :]
    xs = mixed(8, 8, 20, 10, seed=5)[:, :, ::2, :]              # non-contiguous input
    for inp in (x, xs):
        g = mixed(8, 16, 10, 10, seed=6)
        out, grads = run_contract(lambda a, b: F.conv2d(a, b, padding=1), [inp, w], g, FP16)
        check_bilinear(lambda a, b: F.conv2d(a, b, padding=1), [inp, w], out, grads, g, FP16, "conv2d view")


# --- linear and the matmul family -------------------------------------------------------------------------
def _mm_cases():
    a3, w, b = mixed(4, 6, 64, cancel=True), mixed(24, 64, seed=1), mixed(24, seed=2)
    m, n = mixed(12, 64, cancel=True, seed=3), mixed(40, 64, seed=4)
    return {
        "linear 3-D + bias": (lambda x, w, b: F.linear(x, w, b), [a3, w, b]),
        "linear 2-D": (lambda x, w: F.linear(x, w), [m, w]),
        "matmul broadcast": (lambda x, y: torch.matmul(x, y), [a3, mixed(64, 8, seed=5)]),
        "matmul 4-D (attention-like)": (lambda x, y: x @ y, [mixed(2, 3, 8, 32, seed=6),
                                                               mixed(2, 3, 32, 8, seed=7)]),
        "mm, transposed operand": (lambda x, y: torch.mm(x, y.t()), [m, n]),
        "bmm": (lambda x, y: torch.bmm(x, y), [mixed(4, 8, 48, seed=8), mixed(4, 48, 8, seed=9)]),
        "vector @ matrix": (lambda x, y: x @ y, [mixed(64, seed=10, cancel=True), mixed(64, 12, seed=11)]),
        "matrix @ vector": (lambda x, y: torch.matmul(x, y), [m, mixed(64, seed=12)]),
        "addmm (row bias)": (lambda c, x, y: torch.addmm(c, x, y), [mixed(40, seed=13), m, n.t()]),
        "baddbmm": (lambda c, x, y: torch.baddbmm(c, x, y), [mixed(4, 8, 8, seed=14), mixed(4, 8, 48, seed=15),
                                                              mixed(4, 48, 8, seed=16)]),
        "Tensor.addmm": (lambda c, x, y: c.addmm(x, y), [mixed(12, 40, seed=17), m, n.t()]),
    }


@STORED
@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("name", list(_mm_cases()))
def test_matmul_family_forward_and_gradients(name, dtype, autocast):
    fn, operands = _mm_cases()[name]
    operands = [round_to(t.double(), dtype).to(dtype) for t in operands]
    with torch.no_grad():
        shape = fn(*[t.double() for t in operands]).shape
    g = mixed(*shape, dtype=dtype, seed=21) if shape else torch.tensor(1.5, dtype=dtype)
    out, grads = run_contract(fn, operands, g, dtype, autocast)
    check_bilinear(fn, operands, out, grads, g, dtype, name)


def test_fp32_operands_are_rounded_once_as_autocast_rounds_them():
    torch.manual_seed(0)
    x, w = torch.randn(16, 64), torch.randn(8, 64)   # FP32, not representable in FP16
    with torch.autocast("cpu", dtype=FP16), tensor_core_contract():
        out = F.linear(x, w)
    x16, w16 = x.to(FP16), w.to(FP16)
    exact = x16.double() @ w16.double().t()
    bound = fp32_bound(x16.double().abs() @ w16.double().abs().t(), torch.full_like(exact, 64))
    assert_within_contract(out, exact, bound, FP16, "linear on FP32 operands")


# --- attention --------------------------------------------------------------------------------------------
ATTENTION = {
    "plain": {}, "causal": dict(is_causal=True), "scale": dict(scale=0.3),
    "bool mask": dict(mask="bool"), "float mask": dict(mask="float"), "dropout": dict(dropout_p=0.25),
}


@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_attention_forward_and_gradients(name, dtype):
    opts = dict(ATTENTION[name])
    q, k, v = (mixed(2, 3, 17, 16, dtype=dtype, seed=s).mul(0.5).to(dtype) for s in (1, 2, 3))
    dout = mixed(2, 3, 17, 16, dtype=dtype, seed=4)
    mask = None
    if opts.get("mask") == "bool":
        mask = torch.rand(17, 17, generator=torch.Generator().manual_seed(5)) > 0.3
        mask[3] = False                                          # a fully masked row: zeros, as PyTorch
    elif opts.get("mask") == "float":
        mask = (torch.randn(2, 1, 17, 17, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    kwargs = dict(attn_mask=mask, is_causal=opts.get("is_causal", False), scale=opts.get("scale"),
                  dropout_p=opts.get("dropout_p", 0.0))
    torch.manual_seed(123)
    out, (dq, dk, dv) = run_contract(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs),
                                     [q, k, v], dout, dtype)
    keep = None
    if kwargs["dropout_p"]:  # the same Bernoulli draw the contract made (white-box: its shape and order)
        torch.manual_seed(123)
        keep = torch.empty(2, 3, 17, 17).bernoulli_(1 - kwargs["dropout_p"]).bool()
    ref = attention_reference(q, k, v, dout, mask=mask, is_causal=kwargs["is_causal"], scale=kwargs["scale"],
                              keep=keep, dropout_p=kwargs["dropout_p"])
    for label, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        exact, bound = ref[label]
        assert_within_contract(got, exact, bound, dtype, f"attention {name} {label}")
    if mask is not None and mask.dtype == torch.bool:
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


def test_grouped_query_attention():
    q, dout = mixed(2, 4, 9, 8, seed=1), mixed(2, 4, 9, 8, seed=4)
    k, v = mixed(2, 2, 9, 8, seed=2), mixed(2, 2, 9, 8, seed=3)
    out, (dq, dk, dv) = run_contract(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True), [q, k, v], dout, FP16)
    ref = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dout)
    for label, got in (("out", out), ("dq", dq)):
        assert_within_contract(got, *ref[label], FP16, f"gqa {label}")
    for label, got in (("dk", dk), ("dv", dv)):  # two query heads share each key head: sum their terms
        exact, bound = (t.unflatten(1, (2, 2)).sum(2) for t in ref[label])
        assert_within_contract(got, exact, bound * (1 + 4 * 2 ** -24) + exact.abs() * 2 ** -23, FP16,
                               f"gqa {label}")


# --- max pooling ------------------------------------------------------------------------------------------
def test_max_pool_forward_exact_backward_accumulates_in_fp32():
    x = mixed(4, 3, 11, 11, seed=8)
    g = mixed(4, 3, 6, 6, seed=9)
    out, (gx,) = run_contract(lambda t: F.max_pool2d(t, 3, 2, 1), [x], g, FP16)
    xr = x.double().requires_grad_()
    ref = F.max_pool2d(xr, 3, 2, 1)
    assert torch.equal(out.double(), ref.detach()), "max is exact in any precision"
    ref.backward(g.double())
    # each input element sums the gradients of the (up to 4) windows whose maximum it is
    terms = torch.autograd.grad(F.max_pool2d(xr, 3, 2, 1), xr, torch.ones_like(ref))[0]
    bound = fp32_bound(torch.autograd.grad(F.max_pool2d(xr, 3, 2, 1), xr, g.double().abs())[0], terms)
    assert_within_contract(gx, xr.grad, bound, FP16, "max_pool2d input gradient")


# --- mutants: the checks above must reject what the contract forbids --------------------------------------
def _mutants(a, b):
    a32, b32 = a.float(), b.float()

    def fp16_accumulate():
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=FP16)
        for i in range(a.shape[1]):
            acc = (acc.float() + a32[:, i:i + 1] * b32[i:i + 1, :]).to(FP16)  # each partial sum rounded
        return acc

    def split_k_rounded_twice():
        h = a.shape[1] // 2
        parts = [(a32[:, s] @ b32[s, :]).to(FP16) for s in (slice(0, h), slice(h, None))]
        return (parts[0].float() + parts[1].float()).to(FP16)

    return {"FP16 accumulation": fp16_accumulate, "two roundings (split-K in FP16)": split_k_rounded_twice,
            "no final rounding": lambda: a32 @ b32}


@pytest.mark.parametrize("mutant", ["FP16 accumulation", "two roundings (split-K in FP16)", "no final rounding"])
def test_mutants_fail_the_matmul_check(mutant):
    a, b = mixed(64, 256, seed=30), mixed(256, 32, seed=31)
    g = mixed(64, 32, seed=32)
    bad = _mutants(a, b)[mutant]()
    with pytest.raises(AssertionError):
        check_bilinear(lambda x, y: x @ y, [a, b], bad, [None, None], g, FP16, mutant)
    out, grads = run_contract(lambda x, y: x @ y, [a, b], g, FP16)   # while the contract passes
    check_bilinear(lambda x, y: x @ y, [a, b], out, grads, g, FP16, "contract")


def test_mutant_without_operand_rounding_fails():
    torch.manual_seed(2)
    x, w = torch.randn(32, 128), torch.randn(16, 128)
    bad = (x @ w.t()).to(FP16)   # FP32 operands used as they are: the rounding autocast makes is skipped
    x16, w16 = x.to(FP16).double(), w.to(FP16).double()
    with pytest.raises(AssertionError):
        assert_within_contract(bad, x16 @ w16.t(), fp32_bound(x16.abs() @ w16.abs().t(),
                                                               torch.full((32, 16), 128.0)), FP16, "mutant")


def test_attention_mutant_rounding_probabilities_fails():
    """A flash-attention GPU kernel rounds the probabilities to FP16 before P @ V: a second rounding."""
    q, k, v = (mixed(2, 3, 33, 16, seed=s).mul(0.5).to(FP16) for s in (1, 2, 3))
    p = torch.softmax(q.float() @ k.float().transpose(-2, -1) * 0.25, -1)
    bad = (p.to(FP16).float() @ v.float()).to(FP16)
    ref = attention_reference(q, k, v, torch.ones_like(q))
    with pytest.raises(AssertionError):
        assert_within_contract(bad, *ref["out"], FP16, "mutant")


# --- where the mode must change nothing -------------------------------------------------------------------
def _is_contract(t):
    return t.grad_fn is not None and type(t.grad_fn).__name__ in (
        "_ConvolutionBackward", "_LinearBackward", "_MatmulBackward", "_AttentionBackward", "_MaxPool2dBackward")


def test_outside_autocast_nothing_changes():
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(8, 5)
    x, z = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    plain = conv(x), lin(z), z @ z.t()
    with tensor_core_contract():
        inside = conv(x), lin(z), z @ z.t()
    for p, i in zip(plain, inside):
        assert torch.equal(p, i) and i.dtype == torch.float32 and not _is_contract(i)
    with torch.autocast("cpu", dtype=FP16), tensor_core_contract():
        assert _is_contract(conv(x)) and _is_contract(lin(z))   # the same calls under autocast: rerouted
        xd = torch.randn(2, 8, dtype=torch.float64)
        assert not _is_contract(xd @ xd.t().requires_grad_())  # float64 is never autocast


def test_stored_low_precision_only_when_every_operand_is():
    """Outside autocast the contract takes an op whose floating operands are all FP16 (or all BF16); FP32 operands,
    and a mix that PyTorch itself refuses, are left as they are."""
    torch.manual_seed(0)
    w16 = torch.randn(5, 8).half()
    x16 = torch.randn(6, 8).half().requires_grad_()
    with tensor_core_contract():
        assert _is_contract(F.linear(x16, w16)) and _is_contract(x16 @ w16.t())
        assert not _is_contract(F.linear(x16.float(), w16.float()))
        with pytest.raises(RuntimeError):  # FP32 input into FP16 weights: PyTorch's own error, unchanged
            F.linear(x16.float(), w16)


@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "group_norm", "gelu", "cross_entropy"])
def test_stored_low_precision_normalisations_round_once(op, dtype):
    """On FP16/BF16 tensors outside autocast each of these follows the contract, computed in FP32 and rounded once:
    natively (softmax, layer_norm, gelu: contract.py says why) or rerouted (log_softmax, cross_entropy). Each output
    must be the FP64 value rounded once, within the FP32 computation's error."""
    x = mixed(16, 64, dtype=dtype, seed=3)
    x = torch.where(x.abs() > 30, x.sign() * 30, x)  # keep exp() finite in FP64 and FP16 alike
    fns = {"softmax": lambda t: F.softmax(t, -1), "log_softmax": lambda t: F.log_softmax(t, -1),
           "layer_norm": lambda t: F.layer_norm(t, (64,)), "group_norm": lambda t: F.group_norm(t.view(16, 8, 8), 2),
           "gelu": F.gelu,
           "cross_entropy": lambda t: F.cross_entropy(t, torch.arange(16) % 64, reduction="none")}
    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    with tensor_core_contract():
        got = fns[op](x16)
    exact = fns[op](x64)
    g = mixed(*exact.shape, dtype=dtype, seed=5)
    got.backward(g)
    exact.backward(g.double())
    for what, r, e in ((op, got, exact.detach()), (f"{op} gradient", x16.grad, x64.grad)):
        bound = e.abs() * 64 * U32 + (g.double().abs().sum() * 16 * U32 if "gradient" in what else 1e-300)
        if op == "gelu":  # 1 + erf(x/sqrt 2) cancels in FP32 for x << 0 (on a GPU too): erf's FP32 error, times x
            bound = bound + x.double().abs() * 2.0 ** -21 * (g.double().abs() if "gradient" in what else 1)
        assert_within_contract(r, e, bound, dtype, what)


def test_under_no_grad_the_numbers_do_not_change():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = mixed(16, 64).float()
    with torch.autocast("cpu", dtype=FP16), tensor_core_contract():
        with_grad = lin(x)
        with torch.no_grad():
            without = lin(x)
    assert _is_contract(with_grad) and without.grad_fn is None and not without.requires_grad
    assert torch.equal(with_grad, without)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_left_to_the_gpu():
    lin = nn.Linear(16, 8).cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=FP16), torch.autocast("cpu", dtype=FP16), tensor_core_contract():
        y = lin(x)
    assert y.dtype == FP16 and not _is_contract(y)


def test_non_cpu_tensors_fall_through(monkeypatch):
    """Meta tensors stand in for any non-CPU device here: the mode must not touch them."""
    import lab.numerics.contract as mod
    monkeypatch.setattr(mod._Linear, "apply", lambda *a: pytest.fail("rerouted a non-CPU tensor"))
    x, w = torch.empty(4, 16, device="meta"), torch.empty(8, 16, device="meta")
    with torch.autocast("cpu", dtype=FP16), tensor_core_contract():
        assert F.linear(x, w).device.type == "meta"


def test_training_run_records_the_contract(tmp_path, monkeypatch):
    """The label and the fact: an FP16 ViT run computes its patch convolution, every linear layer and the
    attention under the contract; the same run in FP32 hands the contract nothing."""
    from lab.core.config import resolve_run
    from lab.run.train import train
    from conftest import count_contract_calls, tiny_study
    calls = count_contract_calls(monkeypatch)
    metrics = train(resolve_run(tiny_study(), "vit", "fp32", 0), tmp_path / "fp32")
    assert metrics["fp16_path"] == "n/a"
    assert calls == {}
    metrics = train(resolve_run(tiny_study(), "vit", "fp16-static128", 0), tmp_path / "run")
    assert metrics["fp16_path"] == FP16_PATH_CONTRACT and metrics["status"] == "ok"
    assert calls[F.conv2d] > 0 and calls[F.linear] > 0 and calls[F.scaled_dot_product_attention] > 0

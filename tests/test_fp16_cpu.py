"""Fidelity of the fast CPU backward (lab.fp16_cpu) against PyTorch's native reduced-precision kernels."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.fp16_cpu import fast_cpu_backward

torch.set_num_threads(1)


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """FP16 bit patterns mapped to integers whose difference counts representable steps (ulps)."""
    bits = t.to(torch.float16).contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -32768 - bits, bits)


def ulp_distance(a, b) -> int:
    return int((ordered_bits(a) - ordered_bits(b)).abs().max())


def conv_grads(conv, x, fast: bool):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16), (fast_cpu_backward() if fast else torch.enable_grad()):
        y = conv(x)
        y.retain_grad()
    # a weighted sum so every output element gets a different upstream gradient
    (y.float() * torch.linspace(-2, 2, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, conv.weight.grad, conv.bias.grad if conv.bias is not None else None


@pytest.mark.parametrize("cin,cout,k,stride,pad,groups,bias", [
    (8, 16, 3, 1, 1, 1, True),      # plain 3x3
    (16, 16, 3, 2, 1, 16, False),   # depthwise, strided (MobileNet)
    (8, 32, 1, 1, 0, 1, False),     # pointwise (bottleneck)
    (6, 12, 5, 2, 2, 2, True),      # grouped 5x5 with bias
    (3, 8, 4, 4, 0, 1, True),       # patch embedding (ViT)
])
def test_conv_backward_matches_native(cin, cout, k, stride, pad, groups, bias):
    torch.manual_seed(cin * 100 + k)
    native = nn.Conv2d(cin, cout, k, stride, pad, groups=groups, bias=bias)
    fast = copy.deepcopy(native)
    x = torch.randn(4, cin, 12, 12)
    y0, gx0, gw0, gb0 = conv_grads(native, x, fast=False)
    y1, gx1, gw1, gb1 = conv_grads(fast, x, fast=True)
    assert y1.dtype == torch.float16
    assert torch.equal(y0, y1), "forward must be the native FP16 kernel"
    if k > 1:
        assert torch.equal(gw0, gw1), "weight gradients must be bit-identical"
    else:
        # PyTorch computes 1x1 convolutions as a matmul that sums in another order; where terms cancel the
        # two FP32 sums differ in their last bits. Bound: one FP16 ulp at the tensor's largest gradient.
        eps = torch.finfo(torch.float16).eps
        assert float((gw0 - gw1).abs().max()) <= eps * float(gw0.abs().max())
    if bias:
        assert torch.equal(gb0, gb1)
    assert gx0.dtype == gx1.dtype == torch.float32  # autocast casts the FP16 input gradient back
    assert ulp_distance(gx0, gx1) <= 1, "input gradients within one FP16 ulp"


def test_conv_fast_path_really_runs_and_falls_through():
    """The mode reroutes only under CPU FP16 autocast with grad; elsewhere it is the plain op."""
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16), fast_cpu_backward():
        y = conv(x)
    assert "LowPrecisionConv2d" in type(y.grad_fn).__name__
    with fast_cpu_backward():
        y32 = conv(x)
    assert y32.dtype == torch.float32 and "LowPrecision" not in type(y32.grad_fn).__name__
    same = nn.Conv2d(3, 4, 3, padding="same")
    with torch.autocast("cpu", dtype=torch.float16), fast_cpu_backward():
        ys = same(x)
    assert "LowPrecision" not in type(ys.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_backward_at_least_as_accurate_as_native(dtype):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(8, 3, 17, 32).to(dtype) for _ in range(4))

    def grads(fast):
        qq, kk, vv = (t.clone().float().requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=dtype), (fast_cpu_backward() if fast else torch.enable_grad()):
            out = F.scaled_dot_product_attention(qq, kk, vv)
        out.backward(dout.to(out.dtype))
        return out.detach(), [t.grad.double() for t in (qq, kk, vv)]

    out0, native = grads(False)
    out1, fast = grads(True)
    assert torch.equal(out0, out1), "forward must be the native kernel"
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref).backward(dout.double())
    eps = torch.finfo(dtype).eps
    for g_native, g_fast, r in zip(native, fast, ref):
        scale = r.grad.abs().max()
        err_native = float((g_native - r.grad).abs().max() / scale)
        err_fast = float((g_fast - r.grad).abs().max() / scale)
        assert err_fast <= max(err_native, eps / 2) * 1.05, (err_fast, err_native)
        assert err_fast <= eps  # within one ulp of the largest gradient

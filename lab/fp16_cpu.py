"""Reduced-precision training on CPU at usable speed, with reduced-precision numerics kept.

PyTorch's CPU FP16 convolution backward is a slow reference path (~100x slower than FP32 on our 2-core
machines, field-notes section 5), and so is the CPU flash-attention backward in FP16/BF16. A GPU computes
the same things as "low precision in, FP32 accumulate, low precision out" (tensor cores; flash attention
keeps its softmax statistics in FP32). `fast_cpu_backward()` does exactly that on CPU:

* the forward passes stay the native autocast kernels (bit-identical outputs);
* the backward passes widen the saved low-precision tensors to FP32 (exact), run FP32 kernels, and round
  each gradient once to the autocast dtype.

Convolution: weight gradients come out bit-identical to the native FP16 path and input gradients within
one FP16 ulp. Attention: the gradients are at least as close to an FP64 reference as the native kernel's.
tests/test_fp16_cpu.py checks both; benchmarks/bench_fp16_cpu.py measures the speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FP16_PATH_FAST = "cpu-fp32-accumulate-backward"
FP16_PATH_CUDA = "cuda-native"


class _LowPrecisionConv2d(torch.autograd.Function):
    """conv2d on FP16 tensors: native forward; backward computed in FP32 and rounded to FP16."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, padding, dilation, groups, bias is not None)
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conf
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        grads = torch.ops.aten.convolution_backward(
            grad_out.float(), x.float(), weight.float(), [weight.shape[0]] if has_bias else None,
            stride, padding, dilation, False, [0, 0], groups, mask)
        gx, gw, gb = (g.to(x.dtype) if g is not None else None for g in grads)
        return gx, gw, gb, None, None, None, None


class _LowPrecisionAttention(torch.autograd.Function):
    """scaled_dot_product_attention: native forward; flash-attention backward math in FP32."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.scale = scale if scale is not None else q.shape[-1] ** -0.5
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        q32, k32, v32, do = q.float(), k.float(), v.float(), grad_out.float()
        probs = torch.softmax((q32 @ k32.transpose(-2, -1)) * ctx.scale, dim=-1)
        dv = probs.transpose(-2, -1) @ do
        dprobs = do @ v32.transpose(-2, -1)
        # flash attention's row term uses the stored (rounded) output, as the GPU kernel does
        delta = (do * out.float()).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * ctx.scale
        dq, dk = dscores @ k32, dscores.transpose(-2, -1) @ q32
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def _cpu_autocast_dtype():
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv2d under CPU FP16 autocast, with the fast backward (same casts autocast would make)."""
    half = torch.float16
    bias = bias.to(half) if bias is not None else None
    with torch.autocast("cpu", enabled=False):
        return _LowPrecisionConv2d.apply(x.to(half), weight.to(half), bias, _pair(stride), _pair(padding),
                                         _pair(dilation), groups)


def attention(q, k, v, scale=None):
    """F.scaled_dot_product_attention under CPU FP16/BF16 autocast, with the fast backward."""
    dtype = _cpu_autocast_dtype()
    with torch.autocast("cpu", enabled=False):
        return _LowPrecisionAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), scale)


class fast_cpu_backward(TorchFunctionMode):
    """Context manager: reroute conv2d (FP16) and attention (FP16/BF16) while CPU autocast is on.

    Anything it does not cover exactly (string padding, masks, dropout, causal attention, CUDA tensors)
    falls through to the native op, so wrapping a forward pass in it is always safe.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d or func is F.scaled_dot_product_attention:
            dtype = _cpu_autocast_dtype()
            if dtype is not None and args[0].device.type == "cpu" and torch.is_grad_enabled():
                if func is F.conv2d and dtype == torch.float16:
                    names = ("bias", "stride", "padding", "dilation", "groups")
                    merged = dict(zip(names, args[2:]), **kwargs)
                    if not isinstance(merged.get("padding", 0), str):
                        return conv2d(args[0], args[1], **merged)
                elif func is F.scaled_dot_product_attention:
                    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                    merged = dict(zip(names, args[3:]), **kwargs)
                    if (merged.get("attn_mask") is None and not merged.get("dropout_p")
                            and not merged.get("is_causal") and not merged.get("enable_gqa")):
                        return attention(*args[:3], scale=merged.get("scale"))
        return func(*args, **kwargs)

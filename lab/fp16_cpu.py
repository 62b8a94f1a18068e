"""FP16 training on CPU at usable speed, with FP16 numerics kept.

PyTorch's CPU FP16 convolution backward is a slow reference path (~100x slower than FP32 on our 2-core
machines, field-notes section 5). A GPU tensor core computes the same thing as "FP16 in, FP32 accumulate,
FP16 out". We do exactly that on CPU: the forward pass stays the native FP16 convolution, and the backward
pass takes the FP16 tensors, widens them to FP32 (exact), runs the fast FP32 kernel, and rounds the results
back to FP16. Weight gradients come out bit-identical to the native path and input gradients within one
FP16 ulp (tests/test_fp16_cpu.py checks both); every other op is untouched autocast.

Use `enable_fast_fp16_conv(model)`: it only reroutes Conv2d modules, and only while CPU autocast is in FP16.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

FP16_PATH_FAST = "cpu-fp32-accumulate-backward"
FP16_PATH_NATIVE = "native"


class _FP16Conv2d(torch.autograd.Function):
    """conv2d on FP16 tensors; backward computed in FP32 and rounded to FP16."""

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
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad_out.float(), x.float(), weight.float(),
            [weight.shape[0]] if has_bias else None,
            stride, padding, dilation, False, [0, 0], groups, mask)
        half = torch.float16
        return (gx.to(half) if gx is not None else None,
                gw.to(half) if gw is not None else None,
                gb.to(half) if gb is not None else None,
                None, None, None, None)


def _cpu_fp16_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


def conv2d_fp16(x, weight, bias, stride, padding, dilation, groups):
    """What autocast does for conv2d (cast inputs to FP16), with the fast FP16 backward."""
    half = torch.float16
    x, weight = x.to(half), weight.to(half)
    bias = bias.to(half) if bias is not None else None
    with torch.autocast("cpu", enabled=False):
        return _FP16Conv2d.apply(x, weight, bias, _pair(stride), _pair(padding), _pair(dilation), groups)


def _pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def _fast_conv_forward(self, input, weight, bias):
    # Only plain zero padding with explicit sizes maps 1:1 onto convolution_backward; other forms keep the
    # native path (none of the lab's models use them).
    if (_cpu_fp16_autocast() and input.device.type == "cpu" and self.padding_mode == "zeros"
            and not isinstance(self.padding, str)):
        return conv2d_fp16(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)
    return nn.Conv2d._conv_forward(self, input, weight, bias)


def enable_fast_fp16_conv(model: nn.Module) -> int:
    """Route every Conv2d of `model` through the fast FP16 path; returns how many were rerouted."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module._conv_forward = types.MethodType(_fast_conv_forward, module)
            count += 1
    return count

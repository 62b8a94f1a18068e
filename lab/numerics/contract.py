"""Reduced-precision training on CPU under one numerical contract: the GPU tensor core's.

A GPU tensor core computes a matrix product or convolution from FP16/BF16 operands with exact products,
FP32 accumulation and one rounding of each result to the low-precision dtype. A CPU's own FP16 kernels do
not: they differ between CPUs in their last bits (an AMD EPYC without FP16 arithmetic vs an Intel Xeon with
AVX512-FP16/AMX, field-notes section 5) and in speed (up to 100x slower than FP32 for a convolution
backward). `tensor_core_contract()` makes every op that carries the arithmetic compute the contract on
any CPU, forward and backward:

* operands rounded to the autocast dtype exactly as autocast rounds them (FP32 -> FP16/BF16, once);
* widened to FP32 (exact), computed by PyTorch's FP32 kernel (exact products, FP32 accumulation);
* each result, output or gradient, rounded once to the autocast dtype.

So the numbers depend on the FP32 kernel's summation order only (tests/test_fp16_cpu.py bounds that by
mathematics, against an FP64 reference), FP16 costs a few casts rather than a slow kernel, and autograd
still saves the low-precision tensors (activation memory is what the GPU would save).

Rerouted (forward and every gradient), on CPU tensors while CPU autocast is on, and outside autocast when every
floating operand is stored in one of FP16/BF16 (a model loaded with `.half()`, such as a frozen FP16 base model
under FP32 LoRA adapters: the GPU runs those products on its tensor cores as well), with or without grad:
  conv1d/2d/3d, conv_transpose1d/2d/3d (incl. string padding), linear (also on torchao's NF4 weights: QLoRA),
  matmul / @, mm, bmm, addmm, baddbmm, scaled_dot_product_attention (masks, is_causal, scale, dropout,
  enable_gqa: FP32 softmax, one rounding of the output and of each gradient; a GPU flash kernel also rounds
  the probabilities to FP16 before their product with V, which this contract does not), max_pool2d (exact in
  any precision, but its backward sums overlapping windows: FP32 here, rounded once).
Left native, with the reason:
  * elementwise ops, reductions, pooling other than max_pool2d, embedding, dropout: PyTorch's CPU kernels
    compute reduced-precision elementwise ops in FP32 and round each result once, and sums accumulate in
    FP32 (transcendentals such as erf/tanh may differ in the last bit between vector ISAs);
  * ops that CPU autocast runs in FP32 (softmax, log_softmax, layer_norm, group_norm, cross_entropy, ...). On
    FP16/BF16 tensors outside autocast, PyTorch's CPU kernel of softmax accumulates in FP32 (its `opmath` type)
    and rounds each result once, forward and backward, the contract's own rule, so it stays native; log_softmax,
    cross_entropy, nll_loss, layer_norm and group_norm round an intermediate on the CPU (forward or backward), so
    the contract computes them in FP32 from the stored operands and rounds once (tests/test_fp16_cpu.py checks
    each against FP64);
  * batch_norm: autocast leaves its dtype alone; its CPU kernel accumulates statistics in FP32;
  * einsum, addbmm, prelu, conv_tbc, RNNs, nn.MultiheadAttention's fused path: not used by the lab's model
    families; they run as autocast runs them (the CPU's own kernels).
On CUDA tensors, on FP32 operands outside CPU autocast, with float64 or integer operands or mixed dtypes outside
autocast, with `out=`, or for anything not listed, the mode calls the op unchanged: on a GPU the hardware is the
contract.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lab.core.kernel_paths import FP16_PATH_CONTRACT, FP16_PATH_CUDA  # noqa: F401  (metrics.json's fp16_path)

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _widen(t):
    return None if t is None else t.float()


def _widen_mask(mask):
    """An additive (float) mask is widened like an operand; a boolean mask stays boolean."""
    return mask if mask is None or mask.dtype == torch.bool else mask.float()


def _round(t, dtype):
    return None if t is None else t.to(dtype)


class _cpu_autocast_off:
    """CPU autocast switched off for the contract's own calls, its state restored after. torch.autocast(...,
    enabled=False) does the same through ~10 us of Python checks per entry, twice per rerouted op (forward and
    backward): a third of the FP16 step's extra instructions on MobileNet-v2 were Python
    (results/benchmarks/fp16_cpu_instructions.md). Nothing is cast with autocast off, so its cache, which
    torch.autocast's exit clears at the outermost level, holds nothing of these calls."""

    __slots__ = ("was_on",)

    def __enter__(self):
        self.was_on = torch.is_autocast_enabled("cpu")
        torch.set_autocast_enabled("cpu", False)

    def __exit__(self, *exc):
        torch.set_autocast_enabled("cpu", self.was_on)


def _no_autocast(backward):
    """A backward pass computes in FP32 even when .backward() is called inside CPU autocast."""
    def run(ctx, *grads):
        with _cpu_autocast_off():
            return backward(ctx, *grads)
    return run


def _sum_to(t, shape):
    """Sum a broadcast gradient back to an operand's shape (in FP32: part of the accumulation)."""
    return t if t.shape == shape else t.sum_to_size(shape)


class _Convolution(torch.autograd.Function):
    """aten.convolution (any dimension, transposed or not) under the contract."""

    @staticmethod
    def forward(ctx, x, weight, bias, conf):
        ctx.save_for_backward(x, weight)
        ctx.conf, ctx.has_bias = conf, bias is not None
        out = torch.ops.aten.convolution(x.float(), weight.float(), _widen(bias), *conf)
        return out.to(x.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, transposed, output_padding, groups = ctx.conf
        bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]] if ctx.has_bias else None
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        grads = torch.ops.aten.convolution_backward(
            grad_out.float(), x.float(), weight.float(), bias_sizes, stride, padding, dilation, transposed,
            output_padding, groups, mask)
        return *(_round(g, x.dtype) for g in grads), None


class _Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) under the contract; leading dimensions of x are flattened for the grads."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.float(), weight.float(), _widen(bias)).to(x.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.float().reshape(-1, weight.shape[0])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.float()).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # (x^T g)^T, as PyTorch's FP32 linear computes it: the long dimension inside the product (faster)
            gw = (x.float().reshape(-1, weight.shape[1]).t() @ g).t().to(x.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(x.dtype)
        return gx, gw, gb


class _LinearNF4(torch.autograd.Function):
    """torchao's linear_nf4 (its LinearNF4) under the contract: the NF4 weight dequantized by torchao
    (``weight.to(dtype)``) in the forward and again in the backward (only the 4-bit weight is saved, as torchao
    saves it), each product in FP32 from the rounded operands, each result rounded once. The weight is frozen: no
    gradient for it (torchao gives none either)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return F.linear(x.float(), weight.to(x.dtype).float()).to(x.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        weight, = ctx.saved_tensors
        return (grad_out.float() @ weight.to(grad_out.dtype).float()).to(grad_out.dtype), None


class _Matmul(torch.autograd.Function):
    """beta * c + alpha * (a @ b) with torch.matmul's broadcasting (a, b at least 2-D; c optional):
    mm, bmm, matmul, addmm, baddbmm under the contract."""

    @staticmethod
    def forward(ctx, c, a, b, beta, alpha):
        ctx.save_for_backward(a, b)
        ctx.c_shape, ctx.beta, ctx.alpha = (None if c is None else c.shape), beta, alpha
        out = torch.matmul(a.float(), b.float())
        if alpha != 1:
            out = out.mul_(alpha)
        if c is not None:
            out = out.add_(c.float(), alpha=beta) if beta != 0 else out
        return out.to(a.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        g = grad_out.float()
        g_ab = g * ctx.alpha if ctx.alpha != 1 else g
        gc = ga = gb = None
        if ctx.needs_input_grad[0]:
            gc = _sum_to(g * ctx.beta if ctx.beta != 1 else g, ctx.c_shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            ga = _sum_to(g_ab @ b.float().transpose(-2, -1), a.shape).to(a.dtype)
        if ctx.needs_input_grad[2]:
            gb = _sum_to(a.float().transpose(-2, -1) @ g_ab, b.shape).to(a.dtype)
        return gc, ga, gb, None, None


def _attention_probs(q, k, mask, is_causal, scale):
    """FP32 softmax(q k^T * scale + mask); rows with every key masked give zeros (as PyTorch's SDPA)."""
    scores = (q @ k.transpose(-2, -1)).mul_(scale)
    blocked = None
    if is_causal:
        L, S = scores.shape[-2:]
        blocked = torch.ones(L, S, dtype=torch.bool).triu_(1)
    if mask is not None and mask.dtype == torch.bool:
        blocked = ~mask if blocked is None else blocked | ~mask
    elif mask is not None:
        scores = scores + mask
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if blocked is not None or mask is not None:
        # a fully masked row is -inf everywhere (NaN from softmax); a genuine inf/NaN in q or k is not
        empty = (scores == float("-inf")).all(-1, keepdim=True)
        probs = probs.masked_fill(empty, 0.0)
    return probs


def _additive_mask(mask):
    """FP32 additive form of an attention mask (PyTorch's boolean masks: True = may attend)."""
    if mask is None or mask.dtype != torch.bool:
        return _widen(mask)
    return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))


def _flash(q32, k32, v32, mask, is_causal, scale):
    """PyTorch's FP32 flash-attention kernel (online softmax in FP32): output and log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q32, k32, v32, 0.0, is_causal, attn_mask=_additive_mask(mask), scale=scale)


class _Attention(torch.autograd.Function):
    """scaled_dot_product_attention under the contract: FP32 scores, softmax, products; one rounding.

    Without dropout, on 4-D inputs, PyTorch's FP32 flash kernels do the work: autograd saves the low-precision
    inputs and the FP32 log-sum-exp, as a GPU's flash kernel does, and the backward reuses the forward's FP32
    output (kept on ctx, outside autograd's saved tensors: a GPU keeps the FP16 output, which the next op saves
    anyway) instead of running the forward again, which cost ~5% of a ViT step; with dropout, the same
    mathematics written out, the dropout mask drawn here.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, dropout_p, groups):
        q32, k32, v32 = _widen_qkv(q, k, v, groups)
        keep = lse = ctx.out32 = None
        if dropout_p == 0 and q.dim() == 4:
            out, lse = _flash(q32, k32, v32, mask, is_causal, scale)[:2]
            ctx.out32 = out
        else:
            probs = _attention_probs(q32, k32, _widen_mask(mask), is_causal, scale)
            if dropout_p > 0:
                keep = torch.empty_like(probs).bernoulli_(1 - dropout_p).bool()
                probs = probs * keep / (1 - dropout_p)
            out = probs @ v32
        ctx.save_for_backward(q, k, v, mask, keep, lse)
        ctx.conf = (is_causal, scale, dropout_p, groups)
        return out.to(q.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        q, k, v, mask, keep, lse = ctx.saved_tensors
        is_causal, scale, dropout_p, groups = ctx.conf
        q32, k32, v32 = _widen_qkv(q, k, v, groups)
        do = grad_out.float()
        if dropout_p == 0 and q.dim() == 4:
            out = ctx.out32  # freed with the graph, as the saved tensors are
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q32, k32, v32, out, lse, 0.0, is_causal, attn_mask=_additive_mask(mask), scale=scale)
        else:
            dq, dk, dv = _attention_math_backward(q32, k32, v32, do, mask, keep, is_causal, scale, dropout_p)
        if groups > 1:  # each key/value head's gradient sums its query heads' terms, in FP32
            dk = dk.unflatten(-3, (-1, groups)).sum(-3)
            dv = dv.unflatten(-3, (-1, groups)).sum(-3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _widen_qkv(q, k, v, groups):
    q32, k32, v32 = q.float(), k.float(), v.float()
    if groups > 1:  # grouped-query attention: key/value heads shared by `groups` query heads
        k32, v32 = k32.repeat_interleave(groups, -3), v32.repeat_interleave(groups, -3)
    return q32, k32, v32


def _attention_math_backward(q32, k32, v32, do, mask, keep, is_causal, scale, dropout_p):
    probs = _attention_probs(q32, k32, _widen_mask(mask), is_causal, scale)  # recomputed, as flash does
    dprobs = do @ v32.transpose(-2, -1)
    dropped = probs
    if keep is not None:
        dropped = probs * keep / (1 - dropout_p)
        dprobs = dprobs * keep / (1 - dropout_p)
    dv = dropped.transpose(-2, -1) @ do
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
    return dscores @ k32, dscores.transpose(-2, -1) @ q32, dv


class _MaxPool2d(torch.autograd.Function):
    """max_pool2d: the forward is exact in any precision; the backward sums overlapping windows in FP32."""

    @staticmethod
    def forward(ctx, x, conf):
        out, idx = torch.ops.aten.max_pool2d_with_indices(x.float(), *conf)
        ctx.save_for_backward(x, idx)
        ctx.conf = conf
        return out.to(x.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        x, idx = ctx.saved_tensors
        gx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out.float(), x.float(), *ctx.conf, idx)
        return gx.to(x.dtype), None


# --- argument handling: the torch-level signatures, mapped onto the functions above -------------------
def _ntuple(v, n):
    return list(v) if isinstance(v, (tuple, list)) else [v] * n


def _bind(args, kwargs, names, defaults):
    bound = dict(zip(names, args), **kwargs)
    return [bound.get(n, d) for n, d in zip(names, defaults)]


def _same_padding(x, weight, stride, dilation, n):
    """padding='same' as symmetric padding, plus an explicit pad of the input where it is odd (exact)."""
    total = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
    if any(s != 1 for s in stride):
        raise ValueError("padding='same' is not supported for strided convolutions")
    extra = [t % 2 for t in total]
    if any(extra):
        x = F.pad(x, list(itertools.chain.from_iterable((0, e) for e in reversed(extra))))
    return x, [t // 2 for t in total]


def _conv(x, weight, bias, stride, padding, dilation, groups, dtype, n, transposed=False, output_padding=0):
    stride, dilation = _ntuple(stride, n), _ntuple(dilation, n)
    x, weight, bias = x.to(dtype), weight.to(dtype), _round(bias, dtype)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        x, padding = _same_padding(x, weight, stride, dilation, n)
    unbatched = x.dim() == n + 1
    if unbatched:
        x = x.unsqueeze(0)
    conf = (stride, _ntuple(padding, n), dilation, transposed, _ntuple(output_padding, n), groups)
    out = _Convolution.apply(x, weight, bias, conf)
    return out.squeeze(0) if unbatched else out


def _matmul(c, a, b, dtype, beta=1, alpha=1):
    a, b, c = a.to(dtype), b.to(dtype), _round(c, dtype)
    squeeze = []
    if a.dim() == 1:
        a, squeeze = a.unsqueeze(0), squeeze + [-2]
    if b.dim() == 1:
        b, squeeze = b.unsqueeze(-1), squeeze + [-1]
    out = _Matmul.apply(c, a, b, beta, alpha)
    for d in sorted(squeeze):
        out = out.squeeze(d)
    return out


def _attention(dtype, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None and attn_mask.requires_grad:
        return NotImplemented
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(dtype)  # autocast rounds a float mask like any operand
    groups = q.shape[-3] // k.shape[-3] if enable_gqa and q.dim() >= 3 else 1
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Attention.apply(q, k, v, attn_mask, bool(is_causal), scale, float(dropout_p), groups)


def _handlers():
    conv_names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    tconv_names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    table = {}
    for n, conv, tconv in ((1, F.conv1d, F.conv_transpose1d), (2, F.conv2d, F.conv_transpose2d),
                           (3, F.conv3d, F.conv_transpose3d)):
        table[conv] = lambda dt, a, kw, n=n: _conv(*_bind(a, kw, conv_names, (None, None, None, 1, 0, 1, 1)),
                                                   dtype=dt, n=n)
        table[tconv] = lambda dt, a, kw, n=n: _tconv(dt, n, *_bind(a, kw, tconv_names,
                                                                   (None, None, None, 1, 0, 0, 1, 1)))
    table[F.linear] = lambda dt, a, kw: _linear(dt, *_bind(a, kw, ("input", "weight", "bias"), (None,) * 3))
    for f in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
              torch.bmm, torch.Tensor.bmm):
        table[f] = lambda dt, a, kw: _matmul(None, a[0], a[1], dt) if len(a) == 2 and not kw else NotImplemented
    table[torch.Tensor.__rmatmul__] = (
        lambda dt, a, kw: _matmul(None, a[1], a[0], dt) if len(a) == 2 and not kw else NotImplemented)
    for f in (torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm):
        table[f] = lambda dt, a, kw: _addmm(dt, a, kw)
    table[F.scaled_dot_product_attention] = lambda dt, a, kw: _attention(dt, *a, **kw)
    table[F.max_pool2d] = lambda dt, a, kw: _max_pool2d(dt, a, kw)
    table[torch.max_pool2d] = table[F.max_pool2d]
    return table


def _tconv(dtype, n, x, weight, bias, stride, padding, output_padding, groups, dilation):
    if isinstance(padding, str):
        return NotImplemented
    return _conv(x, weight, bias, stride, padding, dilation, groups, dtype, n, transposed=True,
                 output_padding=output_padding)


def _linear(dtype, x, weight, bias):
    if x.dim() == 0 or weight.dim() != 2:
        return NotImplemented
    if _is_nf4(weight):
        # torchao's F.linear on an NF4 weight: linear_nf4, then the bias added to its (rounded) output
        out = _LinearNF4.apply(x.to(dtype), weight)
        return out if bias is None else out + bias
    return _Linear.apply(x.to(dtype), weight.to(dtype), _round(bias, dtype))


def _is_nf4(t) -> bool:
    """torchao's NF4Tensor (a QLoRA base's weight, lab/models/nf4.py), known by name: importing torchao here would
    cost every run its import time."""
    return type(t).__name__ == "NF4Tensor" and type(t).__module__.startswith("torchao.")


def _addmm(dtype, args, kwargs):
    if "out" in kwargs or len(args) != 3:
        return NotImplemented
    return _matmul(args[0], args[1], args[2], dtype, beta=kwargs.get("beta", 1), alpha=kwargs.get("alpha", 1))


def _max_pool2d(dtype, args, kwargs):
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    x, k, stride, padding, dilation, ceil_mode, ret = _bind(args, kwargs, names, (None, None, None, 0, 1, False,
                                                                                  False))
    if ret or x.dim() != 4:
        return NotImplemented
    stride = k if stride is None or stride == [] else stride
    conf = (_ntuple(k, 2), _ntuple(stride, 2), _ntuple(padding, 2), _ntuple(dilation, 2), bool(ceil_mode))
    return _MaxPool2d.apply(x.to(dtype), conf)


_HANDLERS = _handlers()


def _in_fp32_rounded_once(fn):
    """On stored low-precision operands: widen, compute in FP32, round the result once (autograd rounds each
    gradient once on its way back through the cast)."""
    def handler(dtype, args, kwargs):
        if kwargs.get("dtype") is not None:
            return NotImplemented  # the caller asked for an output dtype: PyTorch's own handling
        widen = (lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        return fn(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()}).to(dtype)
    return handler


# Outside autocast only (autocast runs them in FP32 itself): PyTorch's CPU FP16/BF16 kernels of these round an
# intermediate (log_softmax rounds x - max before subtracting the log of the sum: one unit in the last place off
# the once-rounded value in ~11% of outputs; layer_norm's backward is off by several units in ~14% of input
# gradients: tests/test_fp16_cpu.py); a GPU's kernels keep the intermediates in FP32.
_STORED_HANDLERS = {f: _in_fp32_rounded_once(f) for f in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                                                          F.cross_entropy, F.nll_loss, F.layer_norm, F.group_norm)}


def _eligible(args, kwargs) -> bool:
    """CPU floating-point tensors that autocast would cast (float64 is left alone, so is everything else)."""
    found = False
    for t in itertools.chain(args, kwargs.values()):
        if isinstance(t, torch.Tensor):
            if not t.is_cpu or t.dtype == torch.float64:
                return False
            if type(t).__module__.startswith("torchao.") and not _is_nf4(t):
                # torchao's float8 training tensors run their own GEMM (emulated: dequantized operands, FP32
                # accumulation), and refuse autocast's casts: the contract leaves them to it. An NF4 weight
                # dequantizes to an ordinary one: the contract computes its product (_LinearNF4)
                return False
            if not t.is_floating_point() and t.dtype != torch.bool:  # boolean attention masks pass
                return False
            found = True
    return found


def _stored_low_precision(args, kwargs):
    """Outside autocast: the dtype when every floating operand is a CPU tensor of one low-precision dtype (an FP16
    model, e.g. a frozen FP16 base under FP32 adapters), else None (FP32 operands, mixed dtypes: left alone)."""
    dtypes = set()
    for t in itertools.chain(args, kwargs.values()):
        if isinstance(t, torch.Tensor):
            if not t.is_cpu:
                return None
            if t.is_floating_point():
                dtypes.add(t.dtype)  # integer tensors (targets, indices) and boolean masks carry no rounding
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(LOW_PRECISION) else None


def _contract_dtype(args, kwargs):
    """The dtype an op computes in under the contract, or None: the op runs as PyTorch runs it."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        return dtype if dtype in LOW_PRECISION and _eligible(args, kwargs) else None
    return _stored_low_precision(args, kwargs)


class tensor_core_contract(TorchFunctionMode):
    """Context manager: compute the listed ops under the contract, under CPU autocast (FP16 or BF16) and, outside
    it, on operands stored in FP16 or BF16 (a GPU runs a half-precision matmul on its tensor cores too).

    Enter it inside (or together with) `torch.autocast("cpu", ...)`, or around a half-precision model; on FP32
    operands outside autocast, on CUDA tensors, and for every other op it changes nothing.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None and not torch.is_autocast_enabled("cpu"):
            handler = _STORED_HANDLERS.get(func)
        if handler is not None:
            dtype = _contract_dtype(args, kwargs)
            if dtype is not None:
                with _cpu_autocast_off():
                    out = handler(dtype, args, kwargs)
                if out is not NotImplemented:
                    return out
        return func(*args, **kwargs)

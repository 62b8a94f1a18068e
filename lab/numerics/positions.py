"""A language model's gradients by sequence position, FP16 (and FP32) against an FP64 reference.

The question (the source's long-sequence claim): does the accumulation in attention make the gradients at the end of
a long sequence (the tail) abnormal under FP16, and does gradient checkpointing relieve it? ``position_gradients``
runs one forward and backward of the model on one batch in each precision and compares, position by position:

* ``stream``: the gradient of the residual stream where it enters the first block (token + position embeddings), of
  shape (batch, time, width). Under autocast it is an FP32 tensor summed from FP16 pieces: its error is what FP16
  costs the position as a whole;
* ``qkv``: the gradient of every attention's query/key/value projection output, the tensors the attention's backward
  writes (dQ sums over the keys a query sees, dK and dV over the queries that see a key). Under FP16 autocast they
  are FP16 tensors: where FP16's range flushes (to zero or a subnormal) or overflows.

Each precision runs what a training step runs: the loss divided by the run's divisor (accum_steps x emulated_accum,
the magnitudes FP16 sees), FP16 at the run's loss scale (its gradients divided by it, exactly, before comparing).
FP16 and BF16 run under ``lab.numerics.precision.autocast_for`` (on a CPU: the tensor-core contract,
lab/numerics/contract.py); FP32 is the model as it is; the reference is a float64 copy. Gradients are taken with
``torch.autograd.grad`` on the captured tensors only: the parameters' ``.grad`` are left as they were. A model whose
blocks are checkpointed (``model.checkpoint_blocks``) is measured checkpointed.

``attention_paths`` asks where FP16 loses the softmax and its accumulation: from the FP16 run's own query, key and
value (FP16 tensors) it computes each attention's output (a) under the contract (what the lab trains with: FP32
scores, softmax and sums, one rounding), (b) with the probabilities rounded to FP16 before their product with V
(what a GPU flash kernel does), (c) with every sum in FP16 (scores, the softmax's row sum and P @ V, each partial sum
rounded: a kernel that accumulates in FP16), each against the FP64 attention of the same FP16 operands, by query
position.

The tables are long: one row per (tensor, path, position), with sums (norms, counts) that pool exactly over any set
of positions (``pooled``): the tail is the last quarter of the positions, the head the first.
"""
from __future__ import annotations

import contextlib
import copy
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from lab.numerics.contract_reference import round_to
from lab.numerics.precision import DTYPES, autocast_for

#: a reference value at most this fraction of its tensor's largest counts as zero: FP64's residue of a mathematical
#: zero lies near 2^-53 of it, and FP16 at any scale that keeps the largest finite flushes under 2^-40 of it anyway
NOISE = 2.0 ** -44
TAIL = 0.25  # the tail: the last quarter of the positions; the head: the first quarter
COLUMNS = ["tensor", "path", "position", "ref_norm", "err_norm", "rel_err", "ref_rms", "n", "nonzero", "flushed",
           "subnormal", "overflow"]


class _Capture:
    """Forward hooks that keep the residual stream's input to the first block and every attention's qkv output of
    one forward (not of a checkpoint's recompute inside backward: ``active`` is cleared once the forward returns)."""

    def __init__(self, model):
        self.active, self.stream, self.qkv, self.handles = True, None, [], []
        blocks = model.blocks
        self.handles.append(blocks[0].register_forward_pre_hook(self._keep_stream))
        for block in blocks:
            self.handles.append(block.attn.qkv.register_forward_hook(self._keep_qkv))

    def _keep_stream(self, module, args):
        if self.active:
            self.stream = args[0]

    def _keep_qkv(self, module, args, out):
        if self.active:
            self.qkv.append(out)

    def close(self):
        for h in self.handles:
            h.remove()


def _grads(model, idx, targets, precision: str, divisor: float, scale: float):
    """(stream gradient, [qkv gradient per block], [qkv output per block]) of one forward and backward of ``model``
    in ``precision`` ("fp64": the model as it is, float64), at ``scale``; the gradients as the backward left them
    (scaled, in their own dtype)."""
    cap = _Capture(model)
    try:
        # the training step's forward and loss (lab.run.loop.forward_backward: flat_cross_entropy under autocast)
        with autocast_for(precision, idx.device.type) if precision in DTYPES else contextlib.nullcontext():
            logits = model(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / divisor
        cap.active = False
        if scale != 1:  # as LossScaler.scale multiplies: by an FP32 tensor
            loss = loss * torch.full((), scale, dtype=loss.dtype)
        grads = torch.autograd.grad(loss, [cap.stream, *cap.qkv])
    finally:
        cap.close()
    return grads[0], list(grads[1:]), [t.detach() for t in cap.qkv]


def _per_position(tensor: str, path: str, got: torch.Tensor, ref: torch.Tensor, scale: float) -> pd.DataFrame:
    """One row per position: the reference's norm and RMS, the error's norm (``got`` / scale against ``ref``) and the
    counts of ``got``'s values in its own dtype: non-zero in the reference, flushed (zero where the reference is not),
    subnormal (non-zero, under the dtype's smallest normal), overflow (inf or NaN)."""
    g = got.detach()
    finite = torch.isfinite(g)
    tiny = torch.finfo(g.dtype).tiny
    r = ref.detach().to(torch.float64)
    d = g.to(torch.float64) / scale - r  # dividing by a power-of-two scale is exact
    dims = [i for i in range(g.dim()) if i != 1]  # (batch, time, ...): every dimension but time
    ref_norm = r.pow(2).sum(dims).sqrt()
    err_norm = d.pow(2).sum(dims).sqrt()
    # non-zero in the reference: above FP64's rounding residue of a mathematically zero value (a query's gradient
    # at position 0, where the softmax has one key, comes out ~2^-53 of the tensor's values instead of 0)
    nonzero = r.abs() > NOISE * r.abs().max()
    out = pd.DataFrame({
        "tensor": tensor, "path": path, "position": np.arange(g.shape[1]),
        "ref_norm": ref_norm.numpy(), "err_norm": err_norm.numpy(),
        "ref_rms": (ref_norm / math.sqrt(g.numel() / g.shape[1])).numpy(),
        "n": g.numel() // g.shape[1],
        "nonzero": nonzero.sum(dims).numpy(),
        "flushed": (nonzero & (g == 0)).sum(dims).numpy(),
        "subnormal": ((g != 0) & finite & (g.abs() < tiny)).sum(dims).numpy(),
        "overflow": (~finite).sum(dims).numpy()})
    out["rel_err"] = out["err_norm"] / out["ref_norm"]
    return out[COLUMNS]


def position_gradients(model, idx, targets, scale: float = 1.0, divisor: float = 1.0,
                       precisions=("fp32", "fp16")) -> pd.DataFrame:
    """Per-position gradient statistics of ``model`` (the lab's GPT: ``blocks``, each with ``attn.qkv``) on one batch
    (``idx``, ``targets``: (batch, time) token ids), each of ``precisions`` against a float64 copy of the model: the
    long table of COLUMNS, tensors ``stream`` and ``qkv`` (every block's, pooled), paths the precisions. ``scale``
    is the loss scale of the reduced-precision paths (FP32's is 1), ``divisor`` what the loss is divided by before
    backward (a run's accum_steps x emulated_accum). The model is measured in eval mode (no dropout draws) and left
    as it was."""
    was_training = model.training
    model.eval()
    try:
        ref_model = copy.deepcopy(model).double()
        r_stream, r_qkv, _ = _grads(ref_model, idx, targets, "fp64", divisor, 1.0)
        rows = []
        for p in precisions:
            s = 1.0 if p == "fp32" else scale
            stream, qkv, _ = _grads(model, idx, targets, p, divisor, s)
            rows.append(_per_position("stream", p, stream, r_stream, s))
            rows.append(_per_position("qkv", p, torch.cat(qkv, -1), torch.cat(r_qkv, -1), s))
    finally:
        model.train(was_training)
    return pd.concat(rows, ignore_index=True)


# --- where FP16 loses the softmax and its accumulation -----------------------------------------------------------
def _attention64(q, k, v, probs=None):
    """FP64 causal attention of (batch, heads, time, head dim) operands, or of given probabilities: (out, probs)."""
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    if probs is None:
        scores = (q @ k.transpose(-2, -1)) * scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        probs = torch.softmax(scores, -1)
    return probs @ v, probs


def _attention_accum16(q, k, v):
    """Causal attention of FP16 operands with every product, sum and partial sum in FP16, summed in order (first
    index first: the worst order, an upper bound on what a kernel that accumulates in FP16 loses). Torch's CPU FP16
    arithmetic computes each + and x in FP32 and rounds once, which is the correctly rounded FP16 result (FP32 has
    more than 2 x 11 + 2 bits: Figueroa, 'When is double rounding innocuous?', 1995); the head dimension's
    1/sqrt(d) is a power of two here (d = 16) and then exact."""
    B, H, T, d = q.shape
    q, k, v = q.half(), k.half(), v.half()
    scores = torch.zeros(B, H, T, T, dtype=torch.float16)
    for c in range(d):  # q . k, one product and one rounded sum at a time
        scores = scores + q[..., c:c + 1] * k[..., c].unsqueeze(-2)
    scores = (scores * (1.0 / math.sqrt(d))).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # the row maximum is exact; masked keys give 0
    total = torch.zeros(B, H, T, dtype=torch.float16)
    for j in range(T):  # the softmax's row sum over the keys
        total = total + e[..., j]
    probs = e / total.unsqueeze(-1)
    out = torch.zeros(B, H, T, d, dtype=torch.float16)
    for j in range(T):  # out[i] = sum_j P_ij v_j (a masked key adds an exact 0)
        out = out + probs[..., j:j + 1] * v[..., j:j + 1, :]
    return out


def attention_paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> pd.DataFrame:
    """Causal attention of FP16 ``q``, ``k``, ``v`` (batch, heads, time, head dim) by three paths against its FP64
    value on the same operands, by query position (COLUMNS, tensor ``attn_out``): ``contract`` (the lab's:
    scaled_dot_product_attention under FP16 autocast, FP32 softmax and sums, one rounding), ``probs16`` (the
    probabilities rounded to FP16 before P @ V, summed exactly and rounded once: a GPU flash kernel's rounding with
    FP32 accumulation, to within FP32's error), ``accum16`` (every sum in FP16)."""
    from lab.numerics.precision import autocast
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    ref, probs = _attention64(q64, k64, v64)
    with torch.no_grad(), autocast("cpu", torch.float16):
        contract = F.scaled_dot_product_attention(q.half(), k.half(), v.half(), is_causal=True)
    paths = {"contract": contract,
             "probs16": round_to(_attention64(q64, k64, v64, round_to(probs, torch.float16))[0], torch.float16),
             "accum16": _attention_accum16(q, k, v)}
    rows = []
    for name, out in paths.items():  # (b, h, T, d) -> (b, T, h, d): time second, as _per_position reads it
        rows.append(_per_position("attn_out", name, out.to(torch.float64).transpose(1, 2), ref.transpose(1, 2), 1.0))
    return pd.concat(rows, ignore_index=True)


def attention_operands(model, idx, precision: str = "fp16"):
    """Every block's (q, k, v) as ``precision``'s forward computes them on ``idx`` ((batch, heads, time, head dim),
    FP16 under FP16 autocast): what the attention's softmax and sums work on."""
    was_training = model.training
    model.eval()
    cap = _Capture(model)
    try:
        with torch.no_grad(), autocast_for(precision, idx.device.type):
            model(idx)
    finally:
        cap.close()
        model.train(was_training)
    out = []
    for block, qkv in zip(model.blocks, cap.qkv):
        B, T, C3 = qkv.shape
        h = block.attn.n_head
        out.append(tuple(qkv.view(B, T, 3, h, C3 // 3 // h).permute(2, 0, 3, 1, 4)))
    return out


# --- pooling ------------------------------------------------------------------------------------------------------
def pooled(table: pd.DataFrame, positions=None) -> pd.DataFrame:
    """One row per (tensor, path): relative error pooled over ``positions`` (all by default) as the ratio of the
    summed squared norms, the reference's RMS, and the shares of the reference's non-zero values flushed, and of all
    values subnormal and overflowed."""
    t = table if positions is None else table[table["position"].isin(list(positions))]
    g = t.assign(err2=t["err_norm"] ** 2, ref2=t["ref_norm"] ** 2).groupby(["tensor", "path"], sort=False)
    s = g[["err2", "ref2", "n", "nonzero", "flushed", "subnormal", "overflow"]].sum()
    return pd.DataFrame({"rel_err": np.sqrt(s["err2"] / s["ref2"]), "ref_rms": np.sqrt(s["ref2"] / s["n"]),
                         "flushed": s["flushed"] / s["nonzero"].clip(lower=1),
                         "subnormal": s["subnormal"] / s["n"], "overflow": s["overflow"] / s["n"]}).reset_index()


def tail_head(table: pd.DataFrame, tail: float = TAIL) -> dict:
    """A run's scalars from its positions table: pos_{tensor}_{path}_{stat}_{tail|head} for the last and first
    ``tail`` of the positions (at least one each), and the tail over the head (``_ratio``) for the relative error."""
    T = int(table["position"].max()) + 1
    k = max(1, int(round(T * tail)))
    out = {}
    parts = {"tail": pooled(table, range(T - k, T)), "head": pooled(table, range(k))}
    for where, frame in parts.items():
        for _, row in frame.iterrows():
            stats = ["rel_err", "ref_rms"] + (["flushed", "subnormal", "overflow"] if row["tensor"] != "attn_out"
                                              else [])
            for stat in stats:
                out[f"pos_{row['tensor']}_{row['path']}_{stat}_{where}"] = float(row[stat])
    for key in [k_ for k_ in out if k_.endswith("_rel_err_tail")]:
        head = out[key[:-4] + "head"]
        out[key[:-4] + "ratio"] = out[key] / head if head > 0 else math.nan
    return out


# --- a run's probe (train.position_probe) ---------------------------------------------------------------------------
FILE = "positions.csv"  # in a run folder: one row per (tensor, path, position)


def probe(model, idx, targets, precision: str, scale: float, divisor: float) -> tuple[pd.DataFrame, dict]:
    """What a run records (lab/run/train.py): the positions table of ``precision`` (FP16 or BF16, at ``scale``) and
    FP32 against FP64, with every attention's output by the three paths of ``attention_paths`` (on the operands
    FP16's forward computes: the question is FP16's), pooled over the blocks per position, and its tail and head
    scalars (``tail_head``)."""
    table = position_gradients(model, idx, targets, scale, divisor, ("fp32", precision))
    attention = [attention_paths(*(t.cpu() for t in qkv)) for qkv in attention_operands(model, idx, "fp16")]
    table = pd.concat([table, *attention], ignore_index=True)
    # every block's attention pooled per position: the sums add, the shares are recomputed from them by pooled()
    keys = ["tensor", "path", "position"]
    summed = table.groupby(keys, sort=False)[["n", "nonzero", "flushed", "subnormal", "overflow"]].sum()
    squares = table.assign(err_norm=table["err_norm"] ** 2, ref_norm=table["ref_norm"] ** 2).groupby(
        keys, sort=False)[["err_norm", "ref_norm"]].sum() ** 0.5
    out = squares.join(summed).reset_index()
    out["rel_err"] = out["err_norm"] / out["ref_norm"]
    out["ref_rms"] = out["ref_norm"] / np.sqrt(out["n"])
    out = out[COLUMNS]
    return out, tail_head(out)

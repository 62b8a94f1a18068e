"""The sampler and the learner: one GPT (lab/models/gpt.py) computed along two paths that round at different points.

Where each path rounds is written down here and nowhere else: a :class:`Rounding` is a 16-bit format and the set of
points at which a value is rounded to it (every other value stays FP32; every product accumulates in FP32 and is
rounded once, the tensor-core contract). The points of one transformer block, in order:

    ============  ===========================================================================================
    point         the value rounded
    ============  ===========================================================================================
    weights       every parameter held in the format (embeddings and LayerNorms included)
    embed         the token + position embedding that starts the residual stream
    norm_out      a LayerNorm's output
    matmul_in     a matmul's operands, its weight and bias included (what autocast casts)
    matmul_out    a matmul's output (qkv, attention projection, MLP projections, the head)
    attn_scores   q k^T / sqrt(d) before the softmax (eager attention)
    attn_probs    the softmax's probabilities before their product with v (eager attention)
    attn_out      the attention's output (probabilities x v)
    mlp_hidden    the MLP's first projection's output (before GELU)
    act_out       GELU's output
    residual      the residual stream after each add (an inference engine holds it in the format)
    logits        the head's output, before the FP32 log-softmax
    ============  ===========================================================================================

The learner is the trainer's teacher-forced full forward under autocast: ``LEARNER`` rounds where CPU and CUDA
autocast (with the lab's tensor-core contract on a CPU) round the lab's GPT: matmul operands and outputs, GELU's
output, the fused attention's output (its scores and probabilities stay FP32: a fused kernel, as PyTorch's SDPA),
the logits; the residual stream and the LayerNorms stay FP32 (autocast runs layer_norm in FP32 and adds an FP16
output to an FP32 stream in FP32). ``LEARNER_EAGER``: Hugging Face's eager attention under autocast, which also
rounds the scores (an FP16 matmul's output) and the probabilities (an FP16 matmul's operand).

The sampler is an inference engine: weights and activations held in the format, the residual stream too, a KV cache
in the format, attention fused (FP32 internals), sampling from an FP32 softmax of the logits. ``engine(fmt, fuse)``
removes the rounding points inside each fused region: ``residual_norm`` (the add and the LayerNorm after it in one
kernel: the norm reads the FP32 sum, the stream is stored rounded), ``mlp`` (projection, GELU, projection in one
kernel), ``head`` (logits kept in FP32). The mismatch grows with the points the two paths do not share.

A quantized sampler (``Rounding.quant``: a declaration of lab/rl/samplers/, docs/rl.md) adds, on top of its 16-bit
path, four points of its own:

    ============  ===========================================================================================
    point         what the quantization does there
    ============  ===========================================================================================
    weights       each block's linear weights (qkv, attention projection, MLP projections; not the embeddings,
                  LayerNorms, biases or the head) quantized once per rollout (once per policy update: `hold`),
                  from the FP32 master or from the path's 16-bit copy
    matmul_in     W8A8: the activation entering each of those linears quantized (after its 16-bit rounding), the
                  two quantized operands multiplied with an FP32 accumulation; weights-only (W4A16): the
                  dequantized weight rounded to the 16-bit format and multiplied as the plain path multiplies
    KV cache      K and V stored quantized (FP8 E4M3, one scale per layer for each), the attention reading the
                  stored values; the scale a delayed one (`calibrate_kv`, lab/rl/samplers: fixed, current, a
                  predictor)
    head          kept in FP32 when asked (TRL's cast_lm_head_to_fp32: the weight in FP32, FP32 logits)
    ============  ===========================================================================================
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lab.formats import quantize

__all__ = ["Rounding", "POINTS", "FUSIONS", "LEARNER", "LEARNER_EAGER", "QUANTIZED", "engine", "learner", "forward",
           "hold", "calibrate_kv", "logprobs", "sample"]

POINTS = ("weights", "embed", "norm_out", "matmul_in", "matmul_out", "attn_scores", "attn_probs", "attn_out", "mlp_hidden",
          "act_out", "residual", "logits")
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: what each fusion of the sampler keeps in FP32
FUSIONS = {"residual_norm": ("residual_into_norm",), "mlp": ("mlp_hidden", "act_out"), "head": ("logits",)}

LEARNER = frozenset({"matmul_in", "matmul_out", "attn_out", "mlp_hidden", "act_out", "logits"})
LEARNER_EAGER = LEARNER | {"attn_scores", "attn_probs"}
ENGINE = frozenset({"weights", "embed", "norm_out", "matmul_in", "matmul_out", "attn_out", "mlp_hidden", "act_out", "residual",
                    "logits"})
#: the weights a quantized sampler quantizes: each block's linears (inference engines keep the embeddings, the
#: LayerNorms and the head out of their FP8/INT8/FP4 formats)
QUANTIZED = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")


@dataclass(frozen=True)
class Rounding:
    """A path: its format and the points where it rounds to it (``fp32``: none). ``norm_reads_sum``: a fused
    add + LayerNorm, whose norm reads the FP32 sum while the stream is stored rounded."""
    fmt: str
    points: frozenset = field(default_factory=frozenset)
    norm_reads_sum: bool = False
    quant: object = None      # a quantized sampler's declaration (lab/rl/samplers.Quantization), None: none
    kv_scales: object = None  # its KV cache's scales (lab/rl/samplers.KVScales), None: the cache not quantized

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        unknown = set(self.points) - set(POINTS)
        if unknown:
            raise ValueError(f"unknown rounding point(s) {sorted(unknown)}; the points: {', '.join(POINTS)}")
        if self.kv_scales is not None and self.quant is None:
            raise ValueError("a quantized KV cache belongs to a quantized sampler (quant)")

    def r(self, point: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the format at ``point`` (and held in FP32 again), or as it is."""
        if self.fmt == "fp32" or point not in self.points:
            return x
        return x.to(FORMATS[self.fmt]).float()

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """A parameter as the path holds it."""
        return self.r("weights", w.float())


def learner(fmt: str, eager: bool = False) -> Rounding:
    return Rounding(fmt, LEARNER_EAGER if eager else LEARNER)


def engine(fmt: str, fuse: tuple[str, ...] = ()) -> Rounding:
    """The sampler's path: an inference engine's rounding points, less those inside the fused regions ``fuse``."""
    unknown = set(fuse) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusion(s) {sorted(unknown)}; the fusions: {', '.join(FUSIONS)}")
    kept = {p for f in fuse for p in FUSIONS[f]}
    return Rounding(fmt, ENGINE - kept, norm_reads_sum="residual_into_norm" in kept)


def hold(model, rd: Rounding) -> dict:
    """Every parameter as the path holds it, by name (tied ones under each name): ``rd.weight``'s, and for a
    quantized sampler each block's linear weights quantized (dequantized FP32 values) from the FP32 master or the
    16-bit copy, and the head in FP32 when it is kept so. Computed once per rollout: once per policy update."""
    q = rd.quant
    held = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        held[name] = rd.weight(p)
        if q is None:
            continue
        if q.weights is not None and name.startswith("blocks.") and name.endswith(QUANTIZED):
            source = p.detach().float() if q.source == "master" else p.detach().to(FORMATS[rd.fmt]).float()
            held[name] = quantize(source, q.weights, k_dim=1).values
        elif name == "head.weight" and q.head_fp32:
            held[name] = p.float()
    return held


def _linear(rd: Rounding, x, w, b=None, out: str = "matmul_out", into: str = "matmul_in", quantized: bool = False):
    """x w^T + b, ``w`` and ``b`` as the path holds them: the operands rounded (``into`` for x: inside a fused MLP
    the GELU output enters as it is), FP32 accumulation, the output rounded at ``out``. ``quantized``: a quantized
    sampler's linear, W8A8 (x quantized too, the quantized operands multiplied as they are) or weights-only (the
    dequantized weight rounded at matmul_in, as the plain path's)."""
    x = rd.r(into, x)
    act = rd.quant.activations if quantized else None
    if act is not None:
        y = quantize(x, act, k_dim=-1).values @ w.t()
    else:
        y = x @ rd.r("matmul_in", w).t()
    if b is not None:
        y = y + rd.r("matmul_in", b)
    return rd.r(out, y)


def _norm(rd: Rounding, x, held: dict, name: str, eps: float):
    w = held[f"{name}.weight"]
    return rd.r("norm_out", F.layer_norm(x, w.shape, w, held[f"{name}.bias"], eps))


def _attention(rd: Rounding, q, k, v):
    """Causal attention of ``q`` (the last positions) over ``k``, ``v`` (every position so far)."""
    T, S = q.shape[-2], k.shape[-2]
    scores = rd.r("attn_scores", (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])))
    blocked = torch.ones(T, S, dtype=torch.bool, device=q.device).triu_(S - T + 1)
    probs = rd.r("attn_probs", torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1))
    return rd.r("attn_out", probs @ v)


def _add(rd: Rounding, x, y):
    """The residual add: (what the stream stores, what the next LayerNorm reads)."""
    s = x + y
    stored = rd.r("residual", s)
    return stored, (s if rd.norm_reads_sum else stored)


def forward(model, idx: torch.Tensor, rd: Rounding, cache: list | None = None, held: dict | None = None
            ) -> torch.Tensor:
    """FP32 logits (holding the path's values) of ``idx`` (batch, time) continuing ``cache`` (a list of per-block
    (k, v), grown in place; None: no cache, the whole sequence at once), the parameters as ``held`` (`hold`; None:
    held now)."""
    start = cache[0][0].shape[-2] if cache else 0
    T = idx.shape[1]
    if start + T > model.cfg.context:
        raise ValueError(f"{start + T} positions exceed the model's context {model.cfg.context}")
    held = hold(model, rd) if held is None else held
    quantized = rd.quant is not None and rd.quant.weights is not None
    pos = torch.arange(start, start + T, device=idx.device)
    x = rd.r("embed", held["tok.weight"][idx] + held["pos.weight"][pos])
    h_in = x
    for i, blk in enumerate(model.blocks):
        B, _, C = x.shape
        H = blk.attn.n_head
        p = f"blocks.{i}."
        qkv = _linear(rd, _norm(rd, h_in, held, p + "ln1", blk.ln1.eps), held[p + "attn.qkv.weight"],
                      held[p + "attn.qkv.bias"], quantized=quantized)
        q, k, v = qkv.view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        if rd.kv_scales is not None:  # stored quantized: the attention reads what the cache holds
            k, v = rd.kv_scales.store(i, k, v)
        if cache is not None:
            if len(cache) <= i:
                cache.append((k, v))
            else:
                k, v = torch.cat([cache[i][0], k], dim=-2), torch.cat([cache[i][1], v], dim=-2)
                cache[i] = (k, v)
        y = _attention(rd, q, k, v).transpose(1, 2).reshape(B, T, C)
        x, h_in = _add(rd, x, _linear(rd, y, held[p + "attn.proj.weight"], held[p + "attn.proj.bias"],
                                      quantized=quantized))
        f = _linear(rd, _norm(rd, h_in, held, p + "ln2", blk.ln2.eps), held[p + "mlp.fc.weight"],
                    held[p + "mlp.fc.bias"], out="mlp_hidden", quantized=quantized)
        g = rd.r("act_out", F.gelu(f))
        x, h_in = _add(rd, x, _linear(rd, g, held[p + "mlp.proj.weight"], held[p + "mlp.proj.bias"], into="act_out",
                                      quantized=quantized))
    h = _norm(rd, h_in, held, "ln_f", model.ln_f.eps)
    if rd.quant is not None and rd.quant.head_fp32:  # TRL's cast_lm_head_to_fp32: FP32 weight, product and logits
        return h @ held["head.weight"].t()
    # the head: a matmul whose output is rounded at "logits" (a fused head keeps it FP32)
    return _linear(rd, h, held["head.weight"], out="logits")


def calibrate_kv(model, prompt: torch.Tensor, rd: Rounding, held: dict | None = None) -> None:
    """A quantized KV cache's scales for this rollout (``rd.kv_scales.calibrate``, the rule the sampler declares),
    from its calibration: the amax of each layer's K and V over the prefill of ``prompt`` along the path, the cache
    not yet quantized (vLLM's calculate_kv_scales reads the first forward's). Nothing to do without one."""
    if rd.kv_scales is None:
        return
    cache: list = []
    with torch.no_grad():
        forward(model, prompt, dataclasses.replace(rd, kv_scales=None), cache, held)
    rd.kv_scales.calibrate(torch.stack([torch.stack([k.abs().amax(), v.abs().amax()]) for k, v in cache]))


def logprobs(model, tokens: torch.Tensor, prompt_len: int, rd: Rounding) -> torch.Tensor:
    """The learner's log-probability of each generated token (teacher-forced, one full forward): (batch, new)."""
    with torch.no_grad():
        logits = forward(model, tokens[:, :-1], rd)[:, prompt_len - 1:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, prompt_len:, None])[..., 0]


def sample(model, prompt: torch.Tensor, new: int, rd: Rounding, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate ``new`` tokens after ``prompt`` (batch, length) as an inference engine does: the prompt in one
    forward, then one token at a time from the KV cache, each drawn from the FP32 softmax of its logits. Returns
    (prompt + generated tokens, the log-probability mu of each generated token under the sampler)."""
    cache: list = []
    tokens, mus = prompt, []
    with torch.no_grad():
        held = hold(model, rd)  # a quantized sampler's weights: quantized once for the rollout
        calibrate_kv(model, prompt, rd, held)
        step = forward(model, prompt, rd, cache, held)[:, -1]
        for _ in range(new):
            logp = torch.log_softmax(step.float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)
            mus.append(logp.gather(-1, nxt)[:, 0])
            tokens = torch.cat([tokens, nxt], dim=1)
            if len(mus) < new:
                step = forward(model, nxt, rd, cache, held)[:, -1]
    return tokens, torch.stack(mus, dim=1)

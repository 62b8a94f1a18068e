"""A linear layer whose three GEMMs follow a Recipe: operands quantized (lab/formats), dequantized to FP32,
multiplied with FP32 accumulation (or a Hopper accumulator model) and each result rounded once to the autocast dtype:
the tensor-core contract one level down.

The GEMMs are torchao's `Float8Linear` with `emulate=True` written out, operand by operand and layout by layout
(output = x_q @ (w^T)_q; grad_input = go_q @ w_q; grad_weight = go^T_q @ x_q; the bias added outside), so that the
lab's tensorwise and rowwise recipes equal torchao's bit for bit (tests/test_fp8_linear.py). Delayed scaling keeps an
amax history per operand role (input, weight, grad_output), as Transformer Engine does: a step quantizes with the
scale of the history so far, then pushes its own amax. The weight is quantized once per forward and that scale
serves the backward too.

Census: on census steps (lab/fp8/model_census.py gives the layer its rows) each quantized operand adds its census
row, whose saturated, flushed, non-zero and total counts also add up in `counts` (a row per tensor kind: activation,
weight, gradient), without a host sync.
"""
from __future__ import annotations

import fnmatch
import hashlib

import torch
import torch.nn as nn

from lab.core.fp16 import amaxes
from lab.fp8.recipe import Gemm, Recipe
from lab.formats import Quantized, quantize
from lab.formats.scaled import delayed_amax
from lab.fp8.census import NUMBERS, operand_stats
from lab.fp8.recompute import forward_state

KINDS = ("activation", "weight", "gradient")
#: the census row's numbers that `counts` adds up per tensor kind, in its order
COUNTED = [NUMBERS.index(k) for k in ("saturated", "flushed", "nonzero", "numel")]
ROLE_KIND = {"input": 0, "weight": 1, "grad_output": 2}


def _mm(a, b, gemm_: Gemm):
    if gemm_.accumulate == "fp32" and gemm_.k_splits == 1:
        return torch.mm(a, b)
    from lab.formats.accumulate import gemm
    return gemm(a, b, accumulate=gemm_.accumulate, k_splits=gemm_.k_splits)


#: granularities whose quantization of t^T is that of t transposed (one scale per tensor, or per square block):
#: a tensor two GEMMs quantize alike, in either orientation, is quantized once (bits unchanged: quantization is
#: deterministic and elementwise given its scale)
ORIENTATION_FREE = ("tensor", "block", "nvfp4-2d")


def shared(first, second) -> bool:
    """Does an operand quantized as `first` serve, transposed or not, where `second` quantizes the same tensor?"""
    return (first is not None and first == second and first.granularity in ORIENTATION_FREE
            and not first.stochastic and not first.hadamard)


def _t(q: Quantized) -> Quantized:
    return q._replace(**{f: getattr(q, f).t() for f in ("values", "elements", "clipped") if getattr(q, f) is not None})


class _RecipeGemms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        # delayed scaling: the scales of the history so far, kept for the backward's use of the same tensors (a
        # checkpoint's recompute: the forward's scales and stochastic-rounding bits, advancing nothing again)
        with torch.autocast(x.device.type, enabled=False), forward_state(layer) as (amax_x, amax_w, fresh):
            x2 = x.reshape(-1, x.shape[-1])
            f = layer.recipe.forward
            a = layer.quantized(x2, f.a, "input", 1, amax_x, gemm="forward")
            b = layer.quantized(weight.t(), f.b, "weight", 0, amax_w, rounded=x.dtype, gemm="forward")
            out = _mm(a.values, b.values, f).to(x.dtype)
            if fresh:  # the amaxes current scaling read already (Quantized.amax), not read again
                layer.push_amax("input", x2, a.amax), layer.push_amax("weight", weight, b.amax)
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.amax_x, ctx.amax_w = layer, amax_x, amax_w
        # what the backward's GEMMs quantize alike (torchao's tensorwise backward casts these again, to the same bits)
        ctx.x_q = a if layer.shares["input"] else None
        ctx.w_q = _t(b) if layer.shares["weight"] else None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        with torch.autocast(grad_out.device.type, enabled=False):
            go = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            gi, gw = layer.recipe.grad_input, layer.recipe.grad_weight
            amax_go = layer.history_amax("grad_output")
            grad_x = grad_w = None
            go_q = a = None
            if ctx.needs_input_grad[0]:
                go_q = layer.quantized(go, gi.a, "grad_output", 1, amax_go, gemm="grad_input")
                b = layer.quantized(weight, gi.b, "weight", 0, ctx.amax_w, rounded=x.dtype, gemm="grad_input",
                                    reuse=ctx.w_q)
                grad_x = _mm(go_q.values, b.values, gi).to(x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:
                a = layer.quantized(go.t(), gw.a, "grad_output", 1, amax_go, gemm="grad_weight",
                                    reuse=_t(go_q) if go_q is not None and layer.shares["grad_output"] else None)
                b = layer.quantized(x2, gw.b, "input", 0, ctx.amax_x, gemm="grad_weight", reuse=ctx.x_q)
                # rounded once to the autocast dtype, then the FP32 master's gradient (autocast's cast backward)
                grad_w = _mm(a.values, b.values, gw).to(grad_out.dtype).to(weight.dtype)
            read = go_q if go_q is not None else a  # go's first quantization this backward, if any
            layer.push_amax("grad_output", go, None if read is None else read.amax)
            ctx.x_q = ctx.w_q = None
        return grad_x, grad_w, None


def _signs(name: str) -> torch.Tensor:
    """The Hadamard transform's random signs: fixed per layer name, drawn from a generator of its own so that no
    global random number is consumed (every mode of a seed keeps the same data order and dropout)."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % 2 ** 63)
    return torch.randint(0, 2, (16,), generator=g).float() * 2 - 1


class RecipeLinear(nn.Linear):
    """nn.Linear under a Recipe (see the module's docstring); `from_linear` converts one in place of another."""

    def __init__(self, in_features, out_features, bias=True, *, recipe: Recipe, name: str = "", device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe, self.lab_name, self.census = recipe, name, False
        self.delayed = recipe.delayed()  # asked on every operand of every step: once here
        # delayed scaling's rule for the next amax (lab/scaling/predictors: TE's max and most_recent, and others)
        self.predictor = _predictor(recipe) if self.delayed else None
        # while a run records every step's amaxes: this step's (role, amax) per quantized operand, reduced once
        # at the step's end (AmaxRecord.end_step): one op each here, not a reduction and an update per operand
        self.amax_taken = None
        # this step's predictions for the three roles, made for every layer at once (predict_all), and the roles
        # whose history has not changed since: a push makes its role's prediction stale (a second micro-batch)
        self.predicted, self.fresh = None, set()
        f, gi, gw = recipe.forward, recipe.grad_input, recipe.grad_weight
        # per role: is its first quantization a step makes the one its second GEMM needs (`shared`)? Once here too
        self.shares = {"input": shared(f.a, gw.b), "weight": shared(f.b, gi.b), "grad_output": shared(gi.a, gw.a)}
        self.generator = None  # stochastic rounding's bits (lab/fp8/state.py seeds it from the run's seed)
        self.census_rows, self.census_step = None, 0  # the FP8 census's rows and step, on census steps
        self.register_buffer("amax_history", torch.zeros(3, recipe.history_len), persistent=False)
        # per role, the amax its scale in use came from (0: none yet, scale 1): a prediction of 0 (a history with
        # nothing observed in it) keeps that scale, as Transformer Engine keeps its scale (scaled.delayed_amax)
        self.register_buffer("scale_amax", torch.zeros(3), persistent=False)
        self.register_buffer("counts", torch.zeros(3, 4, dtype=torch.int64), persistent=False)
        self.register_buffer("signs", _signs(name), persistent=False)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe, name: str = "") -> "RecipeLinear":
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe, name=name)
        new.weight, new.bias = mod.weight, mod.bias
        device = mod.weight.device
        new.amax_history = torch.zeros(3, recipe.history_len, device=device)
        new.scale_amax = torch.zeros(3, device=device)
        new.counts = torch.zeros(3, 4, dtype=torch.int64, device=device)
        new.signs = _signs(name).to(device)
        return new

    def record_amax(self, on: bool = True) -> None:
        """Keep each operand's (role, amax) of the current step in ``amax_taken`` (the step's amax per role: the
        largest over its micro-batches, AmaxRecord.end_step), whatever the recipe's scaling: the history every
        predictor learns from (lab/fp8/state.py writes it)."""
        self.amax_taken = [] if on else None

    def forward(self, x):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the autocast dtype, as autocast would cast a linear's input
            x = x.to(torch.get_autocast_dtype(device))
        if self.census and not torch.is_grad_enabled():  # an evaluation's forward: not the step's operands
            self.census = False
            try:
                out = _RecipeGemms.apply(x, self.weight, self)
            finally:
                self.census = True
        else:
            out = _RecipeGemms.apply(x, self.weight, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    # --- operands -----------------------------------------------------------------------------------------
    def history_amax(self, role: str):
        """Delayed scaling's amax for this role: the recipe's predictor over the role's history (amax_algorithm:
        TE's max or most_recent, or any registered predictor), the previous one where it predicts nothing
        (scaled.delayed_amax), on the device."""
        if not self.delayed:
            return None
        r = ROLE_KIND[role]
        if r in self.fresh:
            return self.predicted[r]
        amax = delayed_amax(self.predictor(self.amax_history[r]), self.scale_amax[r])
        kept = self.scale_amax.clone()  # not in place: the step's predictions may be this very tensor (predict_all)
        kept[r] = amax
        self.scale_amax = kept
        return amax

    def push_amax(self, role: str, t: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """This step's amax of a role's operand t into the delayed history, or the record's step (amax_taken).
        amax: the amaxes its quantization read already (Quantized.amax: current scaling's), whose maximum is t's
        largest magnitude, the same value as reading t again, at a small reduction's cost or none. Exact ops only,
        outside the CPU contract's function mode (it has nothing to round here and would intercept each call)."""
        if not self.training or not (self.delayed or self.amax_taken is not None):
            return
        r = ROLE_KIND[role]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if self.delayed:
                amax = amaxes([t.detach()])[0]
                row = self.amax_history[r]
                row.copy_(torch.roll(row, 1))
                row[0] = amax
                self.fresh.discard(r)
            elif amax is not None:
                amax = amax if amax.dim() == 0 else amax.amax()
            else:
                low, high = t.detach().aminmax()
                amax = torch.maximum(-low, high)  # max(|low|, |high|) but for the sign of a zero: abs'd when written
            if self.amax_taken is not None:
                self.amax_taken.append((r, amax))

    @torch.no_grad()
    def operand(self, t, fmt, role: str, k_dim: int, history=None, rounded=None, gemm: str = "forward"):
        """t as the GEMM multiplies it (the values of `quantized`)."""
        return self.quantized(t, fmt, role, k_dim, history, rounded, gemm).values

    @torch.no_grad()
    def quantized(self, t, fmt, role: str, k_dim: int, history=None, rounded=None, gemm: str = "forward",
                  reuse: Quantized | None = None) -> Quantized:
        """t quantized by fmt (values dequantized to FP32) or, with fmt None, its high-precision values (the weight
        rounded to the autocast dtype first, as autocast casts it). A random Hadamard transform (fmt.hadamard:
        NVFP4's weight-gradient GEMM, on both operands) rotates t along k before quantizing: it is orthogonal, so
        the exact product is unchanged and only what quantization loses differs. `reuse`: this tensor's quantization
        by another GEMM under the same format (`shared`), in t's orientation: counted by the census, not redone."""
        if fmt is None:
            return Quantized((t if rounded is None else t.to(rounded)).float())
        try:
            if fmt.hadamard:
                from lab.formats.hadamard import random_hadamard
                t = random_hadamard(t, k_dim, self.signs, torch.float32)
            if reuse is not None and self.census and reuse.elements is None:  # quantized off the census: again
                reuse = None
            if history is not None and self.recipe.initial == "current":
                # nothing in the history yet (a first step): the tensor's own amax, not TE's scale 1 (on the device)
                history = torch.where(history > 0, history, amaxes([t])[0])
            q = reuse if reuse is not None else quantize(
                t, fmt, k_dim, history_amax=history, margin=self.recipe.margin, generator=self.generator,
                stats=self.census)
            if fmt.hadamard:  # the rotated operand's amaxes, not t's: a recorder reads t itself
                q = q._replace(amax=None)
        except ValueError as e:
            # a block format's k is the tokens in the weight-gradient GEMM: say which layer and GEMM met it
            raise type(e)(f"{self.lab_name} ({role.replace('_', ' ')} of its {gemm.replace('_', ' ')} GEMM, "
                          f"recipe {self.recipe.name}): {e}") from None  # its own type: a ConfigError stays one
        if self.census and self.census_rows is not None:  # the FP8 census's row of this operand (lab/fp8/census.py)
            numbers = operand_stats(t, q, fmt, k_dim, history)
            self.census_rows.add(self.census_step, self.lab_name, gemm, role, fmt, numbers)
            self.counts[ROLE_KIND[role]] += numbers[COUNTED].long()  # the row's own counts, not counted again
        return q

    def extra_repr(self):
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def convert(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Every nn.Linear of model (but those named by recipe.keep_high, and those whose features do not hold whole
    blocks of the recipe's format: a 10-class head under MXFP8, as Transformer Engine refuses them) replaced by a
    RecipeLinear sharing its parameters; in place, returns model (`model.lab_recipe_kept`: the linears left in high
    precision). A recipe that would convert nothing is refused."""
    block = recipe.block()
    linears = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    asked = [(name, mod) for name, mod in linears if not any(fnmatch.fnmatch(name, p) for p in recipe.keep_high)]
    swaps = [(name, mod) for name, mod in asked if mod.in_features % block == 0 and mod.out_features % block == 0]
    model.lab_recipe_kept = [name for name, _ in linears if name not in dict(swaps)]
    unwhole = [name for name, _ in asked if name not in dict(swaps)]
    if unwhole:  # not asked for in keep_high: said, so that a user who set keep_high: [] knows
        import warnings
        warnings.warn(f"lab.fp8.convert: {', '.join(unwhole)} kept in BF16: features not whole blocks of {block} "
                      f"(recipe {recipe.name})", stacklevel=2)
    if not swaps:
        raise ValueError(f"recipe {recipe.name!r}: the model has no nn.Linear outside keep_high {recipe.keep_high} "
                         f"whose features are multiples of {block}")
    for name, mod in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RecipeLinear.from_linear(mod, recipe, name))
    return model


@torch.no_grad()
def predict_all(layers: list["RecipeLinear"]) -> None:
    """Every delayed layer's three predictions for the step about to start, in one call of their (shared)
    predictor over all their histories (a few tensor operations a step instead of a few per operand); each
    equals the layer's own call bit for bit (tests/test_predictors.py)."""
    layers = [m for m in layers if m.delayed]
    if not layers:
        return
    predicted = layers[0].predictor(torch.stack([m.amax_history for m in layers]))
    predicted = delayed_amax(predicted, torch.stack([m.scale_amax for m in layers]))
    for m, p in zip(layers, predicted):
        m.predicted = m.scale_amax = p  # views of one tensor: no operation per layer
        m.fresh = {0, 1, 2}


def _predictor(recipe: Recipe):
    from lab.scaling.predictors import create_predictor
    return create_predictor(recipe.amax_algorithm, history="fp8")


def recipe_layers(model: nn.Module) -> list[RecipeLinear]:
    return [m for m in model.modules() if isinstance(m, RecipeLinear)]

"""The lab's FP8 recipes against torchao's Float8Linear(emulate=True), bit for bit (the same torch.mm calls on the same
operands), and every quantized GEMM against an FP64 reference of quantize-then-multiply within FP32's accumulation
bound."""
import copy

import pytest
import torch
import torch.nn as nn

from lab.fp8 import create_recipe
from lab.fp8.linear import RecipeLinear, convert

torchao_float8 = pytest.importorskip("torchao.float8")

# the lab's shapes: gpt-tiny's (width 64, 32 x 32 tokens) and the ViT's (width 96, MLP 384, 64 x 17 tokens)
SHAPES = [((32, 32, 64), 192), ((32, 32, 256), 64), ((64, 17, 96), 384), ((64, 17, 384), 96)]
TORCHAO = {"fp8-current": "tensorwise", "fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}


def _pair(recipe_name, k, n, seed):
    torch.manual_seed(seed)
    base = nn.Linear(k, n)
    ours = RecipeLinear.from_linear(copy.deepcopy(base), create_recipe(recipe_name), "layer")
    config = torchao_float8.Float8LinearConfig.from_recipe_name(TORCHAO[recipe_name])
    config = torchao_float8.Float8LinearConfig(**{**config.__dict__, "emulate": True})
    theirs = torchao_float8.float8_linear.Float8Linear.from_float(copy.deepcopy(base), config)
    return ours, theirs


@pytest.mark.parametrize("recipe_name", sorted(TORCHAO))
@pytest.mark.parametrize("shape,n", SHAPES)
def test_equals_torchao_bit_for_bit(recipe_name, shape, n, monkeypatch):
    """Every GEMM is the same torch.mm call as torchao's: the same quantized operands (scales and casts, exact by
    specification) in the same layouts; one kernel on the same operands gives the same bits, so the outputs and
    gradients are equal bit for bit (by construction: no two kernels' sums compared)."""
    ours, theirs = _pair(recipe_name, shape[-1], n, seed=shape[-1] + n)
    # magnitudes over many binades, a zero row (amax 0: the 1e-12 bound) and an outlier
    x = torch.randn(*shape) * torch.exp2(torch.randint(-12, 6, shape).float())
    x[0, 0] = 0
    x[1, 1, 0] = 3e4
    go = torch.randn(*shape[:-1], n) * 1e-3
    mm, gemms = torch.mm, []

    def spy(a, b):  # both layers' GEMMs (torchao's emulation calls torch.mm), by output shape: one of each per layer
        if type(a) is torch.Tensor and type(b) is torch.Tensor:  # not torchao's FP8 tensor subclass, dispatched again
            gemms[-1][(a.shape[0], b.shape[1])] = [(t.detach().clone(), t.stride(), t.storage_offset()) for t in (a, b)]
        return mm(a, b)
    monkeypatch.setattr(torch, "mm", spy)
    outs, grads = [], []
    for layer in (ours, theirs):
        gemms.append({})
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(go)
        outs.append(out), grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
    monkeypatch.undo()
    assert len(gemms[0]) == 3 and gemms[0].keys() == gemms[1].keys()
    for key, operands in gemms[0].items():
        for (t, stride, offset), (t2, stride2, offset2) in zip(operands, gemms[1][key]):
            assert torch.equal(t, t2) and (stride, offset) == (stride2, offset2), key
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _reference_gemm(a, b):
    """The exact product of FP32 operands in FP64 and the bound on FP32 accumulation: |error| <= gamma_K sum |a||b|
    (gamma_K = K u / (1 - K u), u = 2^-24)."""
    exact = a.double() @ b.double()
    k = a.shape[1]
    u = 2.0 ** -24
    return exact, (k * u / (1 - k * u)) * (a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("recipe_name", ["fp8-delayed", "fp8-blockwise", "fp8-noscale", "mxfp8", "nvfp4"])
def test_gemms_equal_quantize_then_multiply(recipe_name, monkeypatch):
    """Each of the three GEMMs is the product of its quantized operands: FP32 accumulation within gamma_K of the
    FP64 product of the dequantized operands the layer produced."""
    torch.manual_seed(0)
    layer = RecipeLinear.from_linear(nn.Linear(256, 128), create_recipe(recipe_name), "layer")
    seen = []
    import lab.fp8.linear as linear

    def spy(a, b, accumulate):
        out = torch.mm(a, b)
        seen.append((a.clone(), b.clone(), out.clone()))
        return out
    monkeypatch.setattr(linear, "_mm", spy)
    x = torch.randn(256, 256, requires_grad=True)
    layer(x).backward(torch.randn(256, 128))
    assert len(seen) == 3
    for a, b, out in seen:
        exact, bound = _reference_gemm(a, b)
        assert ((out.double() - exact).abs() <= bound).all()


def test_convert_keeps_head_and_shares_parameters():
    from lab.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=128, context=16, n_layer=1, d_model=32, n_head=2))
    before = {n: p for n, p in model.named_parameters()}
    convert(model, create_recipe("fp8-current"))
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["head"] == "Linear" and kinds["blocks.0.attn.qkv"] == "RecipeLinear"
    assert all(p is before[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_saturating_cast_clips_beyond_the_maximum_and_inf_as_torchao(element):
    """Values beyond the format's maximum (a delayed scale from a smaller history; inf) are clipped to it, as
    torchao's to_fp8_saturated does, in both formats: torch's own cast overflows to inf in E5M2."""
    from torchao.float8.float8_utils import to_fp8_saturated

    from lab.formats import ELEMENTS
    from lab.formats.scaled import cast, fp8_max
    x = torch.tensor([0.5, -3.0, 1e6, -1e6, float("inf"), -float("inf"), 2 * fp8_max(element)])
    ours, theirs = cast(x, element).float(), to_fp8_saturated(x, ELEMENTS[element]).float()
    assert torch.equal(ours, theirs) and torch.isfinite(ours).all()


def test_delayed_scaling_trains_when_a_gradient_outgrows_its_history():
    """The history's amax is smaller than this step's: E5M2 gradients beyond the maximum saturate, nothing is inf."""
    torch.manual_seed(0)
    layer = RecipeLinear.from_linear(nn.Linear(64, 64), create_recipe({"name": "fp8-delayed", "history_len": 4}), "l")
    x = torch.randn(32, 64)
    for scale in (1e-3, 1.0):  # the second backward's gradient is 1000x the history's amax
        layer(x.clone().requires_grad_(True)).backward(torch.randn(32, 64) * scale)
        assert torch.isfinite(layer.weight.grad).all()
        layer.weight.grad = None


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
def test_delayed_scale_comes_from_the_history_as_transformer_engine_computes_it(algorithm):
    """After steps with input amax 4, then 1: the next forward's input scale is 448 / 4 (max) or 448 / 1
    (most_recent), the step's own amax pushed after it is used; 1 before the history holds any amax."""
    recipe = create_recipe({"name": "fp8-delayed", "history_len": 8, "algorithm": algorithm})
    layer = RecipeLinear.from_linear(nn.Linear(16, 16), recipe, "l")
    for amax in (4.0, 1.0):
        x = torch.zeros(4, 16)
        x[0, 0] = amax
        layer(x)
    want = 4.0 if algorithm == "max" else 1.0
    assert float(layer.history_amax("input")) == want
    fresh = RecipeLinear.from_linear(nn.Linear(16, 16), recipe, "l")
    assert float(fresh.history_amax("input")) == 0.0  # scale_from_amax's delayed rule: scale 1 at amax 0
    # the amax a forward quantized with is the one its backward uses: this step's own push must not change it
    # (most_recent once returned a view of the history's first entry, which the push overwrote)
    used = layer.history_amax("input")
    layer.push_amax("input", torch.full((2, 2), 64.0))
    assert float(used) == want


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
@pytest.mark.parametrize("algorithm,history_len", [("max", 1024), ("most_recent", 8), ("max", 1), ("ema", 1)])
def test_a_step_without_a_finite_positive_amax_keeps_the_scale_as_transformer_engine(bad, algorithm, history_len):
    """Transformer Engine (delayed_scaling.cu) sets scale = max / amax only from a finite, positive amax and keeps
    its scale otherwise. After a step at input amax 2, a step whose input amax is 0 (an all-zero operand), inf or
    NaN: the next step quantizes its input with the scale of amax 2, and its output is finite (once an inf under
    max made the scale 0 and every output NaN for the whole history; 0 and NaN made it 1). history_len 1: the
    history then holds nothing observed, and the layer keeps the scale it had."""
    recipe = create_recipe({"name": "fp8-delayed", "history_len": history_len, "algorithm": algorithm})
    layer = RecipeLinear.from_linear(nn.Linear(16, 16), recipe, "l")
    for amax in (2.0, bad):
        x = torch.zeros(4, 16)
        x[0, 0] = amax
        layer(x)
    assert float(layer.history_amax("input")) == 2.0
    assert torch.isfinite(layer(torch.randn(4, 16))).all()


@pytest.mark.parametrize("algorithm,expected", [("max", [2, 2, 2, 2, 2, 8]), ("most_recent", [2, 2, 8, 8, 8, 8])])
def test_an_inf_amax_holds_the_scale_as_long_as_transformer_engine_holds_it(algorithm, expected):
    """TE's max over a history holding an inf is inf, so its scale stays where it was until the inf leaves the
    history (history_len 4: four steps); most_recent moves on at the next finite amax. Input amaxes 2, inf, 8, 8,
    8, 8: the amax each step's scale comes from afterwards."""
    recipe = create_recipe({"name": "fp8-delayed", "history_len": 4, "algorithm": algorithm})
    layer = RecipeLinear.from_linear(nn.Linear(16, 16), recipe, "l")
    got = []
    for amax in (2.0, float("inf"), 8.0, 8.0, 8.0, 8.0):
        x = torch.zeros(4, 16)
        x[0, 0] = amax
        layer(x)
        got.append(float(layer.history_amax("input")))
    assert got == expected


def test_a_kept_scale_survives_a_checkpoint():
    """The amax a kept scale came from is state: a run resumed where its history holds nothing observed quantizes
    with the scale it had, not with scale 1."""
    from lab.fp8.state import RecipeState
    recipe = create_recipe({"name": "fp8-delayed", "history_len": 1, "algorithm": "most_recent"})
    model, resumed = (convert(nn.Sequential(nn.Linear(16, 16)), recipe) for _ in range(2))
    for amax in (2.0, 0.0):
        x = torch.zeros(4, 16)
        x[0, 0] = amax
        model(x)
    state = RecipeState(model, recipe, seed=0, census_every=0)
    state.begin_step(2)
    again = RecipeState(resumed, recipe, seed=0, census_every=0)
    again.load_state_dict(state.state_dict())
    again.begin_step(2)
    assert float(resumed[0].history_amax("input")) == float(model[0].history_amax("input")) == 2.0


def test_a_hadamard_transform_on_one_operand_only_is_refused():
    from lab.core.config import ConfigError
    from lab.fp8 import Gemm
    from lab.formats import OperandFormat
    with pytest.raises(ConfigError, match="both of its operands"):
        Gemm(OperandFormat("e2m1", "nvfp4", hadamard=True), OperandFormat("e2m1", "nvfp4"))

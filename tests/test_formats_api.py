"""The quantizer API's names say what they are: MX's E8M0 rounding is `scale_rounding`, with a
default; a setting a format ignores is refused; (B, T, C) operands quantize as their 2-D reshape; NVFP4's tensor
scale can be given."""
import pytest
import torch

from lab.core.errors import ConfigError
from lab.formats import OperandFormat, quantize

FORMATS = [OperandFormat("e4m3", g) for g in ("tensor", "row", "tile", "block")] + [
    OperandFormat("e5m2", "tile", stochastic=True), OperandFormat("e4m3", "mx"),
    OperandFormat("e4m3", "mx", scale_rounding="rceil"), OperandFormat("e2m1", "nvfp4"),
    OperandFormat("e2m1", "nvfp4-2d"), OperandFormat("e2m1", "nvfp4", stochastic=True)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_the_default_mx_format_is_the_specs_floor():
    fmt = OperandFormat(element="e4m3", granularity="mx")
    assert fmt.scale_rounding == "floor" and fmt == OperandFormat("e4m3", "mx", scale_rounding="floor")
    x = torch.randn(8, 64)
    assert quantize(x, fmt, 1).values.shape == x.shape


@pytest.mark.parametrize("settings,words", [
    ({"element": "e4m3", "granularity": "nvfp4"}, "element must be e2m1, got 'e4m3': NVFP4's elements are E2M1"),
    ({"element": "e4m3", "granularity": "mx", "scale": "floor"}, "MX's E8M0 rounding is scale_rounding"),
    ({"element": "e4m3", "granularity": "tensor", "scale_rounding": "rceil"}, "tensor quantization ignores scale_rounding"),
    ({"element": "e4m3", "granularity": "mx", "stochastic": True}, "mx quantization ignores stochastic"),
    ({"element": "e2m1", "granularity": "nvfp4", "saturate": False}, "nvfp4 quantization ignores saturate"),
    ({"element": "e2m1", "granularity": "row"}, "element must be one of e4m3, e5m2, got 'e2m1'"),
    ({"element": "e4m3", "granularity": "mx", "scale_rounding": "rciel"}, "did you mean 'rceil'"),
])
def test_a_setting_the_format_ignores_is_refused(settings, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        OperandFormat(**settings)


def test_a_tensor_scale_is_nvfp4s_alone():
    with pytest.raises(ConfigError, match="tensor_scale is NVFP4's"):
        quantize(torch.randn(4, 32), OperandFormat("e4m3", "tensor"), 1, tensor_scale=1.0)
    with pytest.raises(ValueError, match="positive finite"):
        quantize(torch.randn(4, 32), OperandFormat("e2m1", "nvfp4"), 1, tensor_scale=0.0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.element}-{f.granularity}-{f.stochastic}")
def test_a_btc_operand_quantizes_as_its_2d_reshape_bit_for_bit(fmt):
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 5] *= 300  # a row far from the rest: per-row and per-block scales differ from the tensor's
    kw = {"stats": True, "history_amax": None}
    q = quantize(x, fmt, -1, generator=torch.Generator().manual_seed(4), **kw)
    r = quantize(x.reshape(-1, 64), fmt, 1, generator=torch.Generator().manual_seed(4), **kw)
    for got, want in zip(q[:3], r[:3]):  # values, elements, clipped (amax: per block, in the quantizer's shape)
        assert got.shape == x.shape and torch.equal(bits(got.reshape(want.shape)), bits(want))
    assert (q.amax is None) == (r.amax is None) and (q.amax is None or torch.equal(q.amax.max(), r.amax.max()))
    with pytest.raises(ValueError, match="along its last dimension"):
        quantize(x, fmt, 1)


@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4-2d"])
def test_a_given_nvfp4_tensor_scale_is_the_one_used(granularity):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    fmt = OperandFormat("e2m1", granularity)
    computed = x.abs().max() / (448.0 * 6.0)  # torchao's per_tensor_scale, in FP32
    own = quantize(x, fmt, 1, stats=True)
    same = quantize(x, fmt, 1, stats=True, tensor_scale=computed)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(own[:3], same[:3]))
    # a different scale is the one used: x's blocks under the tensor scale of x with 16 more rows holding a larger
    # amax are what that larger tensor's own quantization gives them (blocks are independent given the tensor scale)
    big = torch.cat([x, torch.zeros(16, 64)])
    big[-1, 0] = 37.0 * x.abs().max()
    given = quantize(x, fmt, 1, tensor_scale=big.abs().max() / (448.0 * 6.0)).values
    assert torch.equal(bits(given), bits(quantize(big, fmt, 1).values[:32]))
    assert not torch.equal(given, own.values)


@pytest.mark.parametrize("fmt", FORMATS + [OperandFormat("e4m3", "row", scale="pow2"),
                                           OperandFormat("e4m3", "tensor", scale="delayed")], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
def test_quantized_amax_is_the_operands_own_largest_magnitude_or_none(fmt, transposed):
    """Quantized.amax: the amaxes current scaling read (a recorder's, lab/fp8/amax_record.py), whose maximum is x's
    largest magnitude (FP64 reference), also through a transposed view and a (B, T, C) reshape; None where the scale
    did not come from x (delayed scaling: the history's amax) or the quantizer keeps its own (MX, NVFP4)."""
    x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 128)
    x = x.reshape(128, 128).t() if transposed else x
    history = torch.tensor(7.0) if fmt.scale == "delayed" else None
    q = quantize(x, fmt, -1, history_amax=history)
    if fmt.scale == "delayed" or fmt.granularity in ("mx", "nvfp4", "nvfp4-2d"):
        assert q.amax is None
    else:
        assert float(q.amax.double().max()) == float(x.double().abs().max())

"""fp8-blockwise: DeepSeek-V3's recipe (arXiv:2412.19437): E4M3 for every GEMM operand, activations and gradients
scaled per 1x128 tile along each GEMM's reduction dimension, weights per 128x128 block, current (online) scales;
embedding, head and norms stay in BF16. DeepSeek promotes partial sums to FP32 every 128 products on Hopper: the
contract's FP32 accumulation here, `accumulate: promote` for the Hopper model. Transformer Engine's
`Float8BlockScaling` is the same tiling."""
from lab.fp8 import Gemm, Recipe, register_recipe
from lab.recipes import fp8


@register_recipe("fp8-blockwise")
def fp8_blockwise() -> Recipe:
    t, b = fp8("e4m3", "tile"), fp8("e4m3", "block")
    return Recipe("fp8-blockwise", Gemm(t, b), Gemm(t, b), Gemm(t, t), source="DeepSeek-V3, arXiv:2412.19437")

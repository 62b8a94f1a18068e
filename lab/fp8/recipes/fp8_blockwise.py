"""fp8-blockwise: DeepSeek-V3's recipe (arXiv:2412.19437): E4M3 for every GEMM operand, activations and gradients
scaled per 1x128 tile along each GEMM's reduction dimension, weights per 128x128 block, current (online) scales;
embedding, head and norms stay in BF16. DeepSeek promotes partial sums to FP32 every 128 products on Hopper: the
contract's FP32 accumulation here, `accumulate: promote` for the Hopper model. Transformer Engine's
`Float8BlockScaling` is the same tiling. grad_element: e5m2 gives the gradients E5M2's range at the same tiling
(the claim that E4M3 gradients with block scales lose nothing against it)."""
from typing import Annotated, Literal

from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-blockwise")
def fp8_blockwise(grad_element: Annotated[Literal["e4m3", "e5m2"], "the output gradients' element format (e5m2: 2^16 more range, less precision)"] = "e4m3") -> Recipe:
    x, w, g = fp8("e4m3", "tile"), fp8("e4m3", "block"), fp8(grad_element, "tile")
    name = "fp8-blockwise" + ("" if grad_element == "e4m3" else "-e5m2-grads")
    return Recipe(name, Gemm(x, w), Gemm(g, w), Gemm(g, x), source="DeepSeek-V3, arXiv:2412.19437")

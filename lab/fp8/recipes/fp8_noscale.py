"""fp8-noscale: FP8 without a scale (every scale 1): E4M3 forward, E5M2 gradients, saturating: FP16-noscale's
analogue one level down (values above 448 clipped, gradients below E5M2's 2^-16 flushed)."""
from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-noscale")
def fp8_noscale() -> Recipe:
    x, w, g = fp8("e4m3", scale="one"), fp8("e4m3", scale="one"), fp8("e5m2", scale="one")
    return Recipe("fp8-noscale", Gemm(x, w), Gemm(g, w), Gemm(g, x), source="the lab: FP16-noscale's analogue")

"""fp8-current: one scale per tensor from its current amax; E4M3 forward, E5M2 gradients (torchao's `tensorwise`
recipe, Transformer Engine's `Float8CurrentScaling` with the HYBRID format)."""
from lab.fp8 import Gemm, Recipe, register_recipe
from lab.recipes import fp8


@register_recipe("fp8-current")
def fp8_current() -> Recipe:
    x, w, g = fp8("e4m3"), fp8("e4m3"), fp8("e5m2")
    return Recipe("fp8-current", Gemm(x, w), Gemm(g, w), Gemm(g, x),
                  source="torchao Float8LinearConfig.from_recipe_name('tensorwise'); TE Float8CurrentScaling")

"""fp8-current: one scale per tensor from its current amax; E4M3 forward, E5M2 gradients (torchao's `tensorwise`
recipe, Transformer Engine's `Float8CurrentScaling` with the HYBRID format)."""
from typing import Annotated, Literal

from lab.core.settings import Range
from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-current")
def fp8_current(grad_element: Annotated[Literal["e4m3", "e5m2"], "the output gradients' element format (e4m3: "
                                        "every operand E4M3, gradients flush more)"] = "e5m2",
                amax_floor: Annotated[float, Range(ge=0), "the smallest amax a scale is computed from (0: an "
                                      "all-zero tensor gets an infinite scale and NaN, torchao before ao#3356)"]
                = 1e-12) -> Recipe:
    # grad_element e4m3: every operand in E4M3 under a per-tensor scale (gradients flush: lab diagnose's catalogue);
    # amax_floor 0: torchao before pytorch/ao#3356 (an all-zero tensor: an infinite scale, NaN)
    x = w = fp8("e4m3", amax_floor=amax_floor)
    g = fp8(grad_element, amax_floor=amax_floor)
    return Recipe("fp8-current", Gemm(x, w), Gemm(g, w), Gemm(g, x),
                  source="torchao Float8LinearConfig.from_recipe_name('tensorwise'); TE Float8CurrentScaling")

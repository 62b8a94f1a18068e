"""fp8-rowwise: torchao's `rowwise`: E4M3 for every operand, a scale per row along each GEMM's reduction dimension,
rounded down to a power of two."""
from typing import Annotated

from lab.core.settings import Range
from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-rowwise")
def fp8_rowwise(amax_floor: Annotated[float, Range(ge=0), "the smallest amax a row's scale is computed from (0: "
                                      "an all-zero row gets an infinite scale and NaN, torchao before ao#3356)"]
                = 1e-12) -> Recipe:
    # amax_floor 0: torchao before pytorch/ao#3356 (an all-zero row: an infinite scale, NaN)
    r = fp8("e4m3", "row", "pow2", amax_floor=amax_floor)
    return Recipe("fp8-rowwise", Gemm(r, r), Gemm(r, r), Gemm(r, r),
                  source="torchao Float8LinearConfig.from_recipe_name('rowwise')")

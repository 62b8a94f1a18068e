"""fp8-rowwise: torchao's `rowwise`: E4M3 for every operand, a scale per row along each GEMM's reduction dimension,
rounded down to a power of two."""
from lab.fp8 import Gemm, Recipe, register_recipe
from lab.recipes import fp8


@register_recipe("fp8-rowwise")
def fp8_rowwise() -> Recipe:
    r = fp8("e4m3", "row", "pow2")
    return Recipe("fp8-rowwise", Gemm(r, r), Gemm(r, r), Gemm(r, r),
                  source="torchao Float8LinearConfig.from_recipe_name('rowwise')")

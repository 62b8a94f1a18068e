"""fp8-rowwise-gw-hp: torchao's `rowwise_with_gw_hp`: rowwise forward, the input gradient from row-scaled output
gradients and a tensor-scaled weight, the weight gradient's GEMM in high precision (BF16 operands)."""
from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-rowwise-gw-hp")
def fp8_rowwise_gw_hp() -> Recipe:
    r = fp8("e4m3", "row", "pow2")
    return Recipe("fp8-rowwise-gw-hp", Gemm(r, r), Gemm(r, fp8("e4m3", "tensor", "pow2")), Gemm(None, None),
                  source="torchao Float8LinearConfig.from_recipe_name('rowwise_with_gw_hp')")

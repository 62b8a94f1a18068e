"""mxfp8: OCP MX v1.0's MXFP8: 32-value blocks along each GEMM's reduction dimension sharing an E8M0 (power-of-two)
scale, E4M3 elements for every tensor, gradients included (Mishra et al. 2025, arXiv:2506.08027). The scale's
rounding: floor (the specification's, which diverged there) or rceil (rounding up, which matched BF16), ceil, even."""
from typing import Annotated, Literal

from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.formats import OperandFormat


@register_recipe("mxfp8")
def mxfp8(rounding: Annotated[Literal["floor", "rceil", "ceil", "even"], "how a block's E8M0 scale is rounded "
                              "(floor: the OCP spec's, clips a block whose amax mantissa passes the element's; "
                              "rceil: never clips)"] = "rceil",
          element: Annotated[Literal["e4m3", "e5m2"], "every operand's element format"] = "e4m3") -> Recipe:
    m = OperandFormat(element=element, granularity="mx", scale_rounding=rounding)
    return Recipe(f"mxfp8-{rounding}", Gemm(m, m), Gemm(m, m), Gemm(m, m),
                  source="OCP MX v1.0; Mishra et al. 2025, arXiv:2506.08027")

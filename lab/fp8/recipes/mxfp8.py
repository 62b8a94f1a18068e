"""mxfp8: OCP MX v1.0's MXFP8: 32-value blocks along each GEMM's reduction dimension sharing an E8M0 (power-of-two)
scale, E4M3 elements for every tensor, gradients included (Mishra et al. 2025, arXiv:2506.08027). The scale's
rounding: floor (the specification's, which diverged there) or rceil (rounding up, which matched BF16), ceil, even."""
from typing import Literal

from lab.fp8 import Gemm, Recipe, register_recipe
from lab.formats import OperandFormat


@register_recipe("mxfp8")
def mxfp8(rounding: Literal["floor", "rceil", "ceil", "even"] = "rceil",
          element: Literal["e4m3", "e5m2"] = "e4m3") -> Recipe:
    m = OperandFormat(element=element, granularity="mx", scale_rounding=rounding)
    return Recipe(f"mxfp8-{rounding}", Gemm(m, m), Gemm(m, m), Gemm(m, m),
                  source="OCP MX v1.0; Mishra et al. 2025, arXiv:2506.08027")

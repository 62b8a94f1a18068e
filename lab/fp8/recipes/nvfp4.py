"""nvfp4: NVIDIA's NVFP4 pre-training recipe (arXiv:2509.25149): E2M1 elements in 16-value blocks with E4M3 block
scales and an FP32 tensor scale; weights in 16x16 2-D blocks (the same quantization forward and backward), random
Hadamard transforms on the weight-gradient GEMM's operands, stochastic rounding of the gradients; the head in BF16.
Each of rht, two_d_weights and stochastic can be turned off (the paper's ablations)."""
from typing import Annotated

from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.formats import OperandFormat


@register_recipe("nvfp4")
def nvfp4(rht: Annotated[bool, "a random Hadamard transform on both operands of the weight-gradient GEMM"] = True,
          two_d_weights: Annotated[bool, "the weight in 16x16 blocks (one scale for it and its transpose)"] = True,
          stochastic: Annotated[bool, "the gradients stochastically rounded"] = True) -> Recipe:
    x = OperandFormat(element="e2m1", granularity="nvfp4")
    w = OperandFormat(element="e2m1", granularity="nvfp4-2d" if two_d_weights else "nvfp4")
    g = OperandFormat(element="e2m1", granularity="nvfp4", stochastic=stochastic)
    g_wgrad = OperandFormat(element="e2m1", granularity="nvfp4", stochastic=stochastic, hadamard=rht)
    x_wgrad = OperandFormat(element="e2m1", granularity="nvfp4", hadamard=rht)
    off = [k for k, v in (("rht", rht), ("2d", two_d_weights), ("sr", stochastic)) if not v]
    name = "nvfp4" + "".join(f"-no-{k}" for k in off)
    return Recipe(name, Gemm(x, w), Gemm(g, w), Gemm(g_wgrad, x_wgrad), source="NVIDIA 2025, arXiv:2509.25149")

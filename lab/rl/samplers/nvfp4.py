"""nvfp4: E2M1 elements, one E4M3 scale per 16 along k and an FP32 tensor scale, for weights and activations
(Blackwell's W4A4); ``weights_only``: NVFP4 weights over 16-bit activations (QeRL's W4A16 sampler)."""
from typing import Annotated

from lab.formats import OperandFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("nvfp4")
def nvfp4(weights_only: Annotated[bool, "activations left in the path's format (W4A16, QeRL)"] = False
          ) -> Quantization:
    fmt = OperandFormat("e2m1", "nvfp4")
    return Quantization("nvfp4", weights=fmt, activations=None if weights_only else fmt,
                        origin="NVFP4 arXiv:2509.25149; QeRL arXiv:2510.11696")

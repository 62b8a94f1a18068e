"""fp8-blockwise: DeepSeek-V3's scaling as verl's FP8 rollout runs it (``rollout.quantization=fp8``): E4M3 weights
with one scale per 128x128 block, activations one per 1x128 tile along k (a dimension under 128: one short tile)."""
from typing import Annotated

from lab.formats import OperandFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("fp8-blockwise")
def fp8_blockwise(weights_only: Annotated[bool, "activations left in the path's format (W8A16)"] = False
                  ) -> Quantization:
    return Quantization("fp8-blockwise", weights=OperandFormat("e4m3", "block"),
                        activations=None if weights_only else OperandFormat("e4m3", "tile"),
                        origin="verl rollout.quantization=fp8; DeepSeek-V3 arXiv:2412.19437")

"""fp8-tensor: vLLM's dynamic FP8 (``quantization="fp8"``), the rollout FlashRL and verl#7519's tensorwise arm run:
E4M3 weights with one scale per tensor, the activations E4M3 with one scale per tensor computed each forward."""
from typing import Annotated

from lab.formats import OperandFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("fp8-tensor")
def fp8_tensor(weights_only: Annotated[bool, "activations left in the path's format (W8A16)"] = False) -> Quantization:
    fmt = OperandFormat("e4m3", "tensor")
    return Quantization("fp8-tensor", weights=fmt, activations=None if weights_only else fmt,
                        origin="vLLM quantization=fp8; FlashRL")

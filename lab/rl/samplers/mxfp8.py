"""mxfp8: OCP MX (E4M3 elements, one E8M0 power-of-two scale per 32 along k) for weights and activations, as
verl#7519's MXFP8 arm."""
from typing import Annotated

from lab.formats import OperandFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("mxfp8")
def mxfp8(weights_only: Annotated[bool, "activations left in the path's format (W8A16)"] = False) -> Quantization:
    fmt = OperandFormat("e4m3", "mx")
    return Quantization("mxfp8", weights=fmt, activations=None if weights_only else fmt,
                        origin="OCP MX v1.0; verl#7519")

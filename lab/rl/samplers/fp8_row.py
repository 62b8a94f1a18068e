"""fp8-row: E4M3 weights with one scale per output channel, activations one scale per token (vLLM's
FP8 per-channel weights with dynamic per-token activations: llm-compressor's FP8_DYNAMIC scheme)."""
from typing import Annotated

from lab.formats import OperandFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("fp8-row")
def fp8_row(weights_only: Annotated[bool, "activations left in the path's format (W8A16)"] = False) -> Quantization:
    fmt = OperandFormat("e4m3", "row")
    return Quantization("fp8-row", weights=fmt, activations=None if weights_only else fmt,
                        origin="vLLM FP8 per-channel / per-token (llm-compressor FP8_DYNAMIC)")

"""int8-row: symmetric INT8 weights with one scale per output channel, activations one per token (FlashRL's INT8
W8A8 rollout; torchao's affine quantization, lab/formats/integer.py)."""
from typing import Annotated

from lab.formats import IntFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("int8-row")
def int8_row(weights_only: Annotated[bool, "activations left in the path's format (W8A16)"] = False) -> Quantization:
    fmt = IntFormat(8, "row")
    return Quantization("int8-row", weights=fmt, activations=None if weights_only else fmt, origin="FlashRL INT8")

"""w4a16: symmetric INT4 weights with one scale per group along k, activations in the path's 16-bit format (the
GPTQ/AWQ serving format; torchao's affine quantization, lab/formats/integer.py). GPTQ and AWQ default to groups of
128; 32 here, the group the lab's GPT's 64-wide layers hold whole, as torchao's QAT default."""
from typing import Annotated

from lab.core.settings import Range
from lab.formats import IntFormat
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("w4a16")
def w4a16(group: Annotated[int, Range(ge=1), "weights per scale along k (a layer's in-features a multiple)"] = 32
          ) -> Quantization:
    return Quantization("w4a16", weights=IntFormat(4, "group", group), origin="GPTQ / AWQ W4A16")

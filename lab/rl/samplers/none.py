"""none: nothing quantized, the 16-bit path as it is; with a sampler line's kv, head_fp32 (one factor at a time)."""
from lab.rl.samplers import Quantization, register_sampler


@register_sampler("none")
def none() -> Quantization:
    return Quantization("none", weights=None)

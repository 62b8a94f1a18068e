"""``geometric``: geometric-mean rejection, no importance weight: a sequence is kept (weight 1) when the geometric
mean of its tokens' ratios, (prod_t rho_t)^(1/T), lies in [low, high], and rejected whole (weight 0) outside
(verl's Geo-RS, `rollout_rs: seq_mean_k1`, typical bounds 0.999-1.001; DeepSeek-V3.2). Length-invariant: a per-token
drift of 0.01 is 1.01 at any length, where the product is e^(0.01 T)."""
from typing import Annotated

from lab.core.settings import Range
from lab.rl.corrections import Correction, register_correction, sequence_log_ratio


@register_correction("geometric")
class Geometric(Correction):
    formula = "1[low <= (prod_t rho_t)^(1/T) <= high]"
    equivalent = "verl `rollout_rs: seq_mean_k1`, `rollout_rs_threshold: low_high`; no TRL mode"

    def __init__(self, low: Annotated[float, Range(gt=0, le=1), "the smallest geometric-mean ratio kept"] = 0.999,
                 high: Annotated[float, Range(ge=1), "the largest geometric-mean ratio kept"] = 1.001):
        self.low, self.high = float(low), float(high)

    def weigh(self, log_ratio, mask):
        import torch
        rho = torch.exp(sequence_log_ratio(log_ratio, mask, mean=True))
        keep = ((rho >= self.low) & (rho <= self.high)).expand_as(mask)
        return keep.to(log_ratio.dtype), keep

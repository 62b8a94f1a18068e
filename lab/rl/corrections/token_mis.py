"""``token-mis`` (also ``icepop``): token-level masked importance sampling, rho_t where low <= rho_t <= high and the
token rejected (weight 0) outside (IcePop, arXiv:2510.18855: [0.5, 5])."""
from typing import Annotated

from lab.core.settings import Range
from lab.rl.corrections import Correction, register_correction


@register_correction("token-mis", "icepop")
class TokenMIS(Correction):
    formula = "rho_t * 1[low <= rho_t <= high]"
    equivalent = ("TRL `token_mask`, `vllm_importance_sampling_clip_min` = low, `..._clip_max` = high; verl "
                  "`rollout_is: token` with `rollout_rs: token_k1`")

    def __init__(self, low: Annotated[float, Range(gt=0, le=1), "the smallest ratio kept"] = 0.5,
                 high: Annotated[float, Range(ge=1), "the largest ratio kept"] = 5.0):
        self.low, self.high = float(low), float(high)

    def weigh(self, log_ratio, mask):
        import torch
        rho = torch.exp(log_ratio)
        keep = (rho >= self.low) & (rho <= self.high)
        return rho.masked_fill(~keep, 0.0), keep

"""``sequence-tis``: sequence-level truncated importance sampling, every token of a sequence weighted by
min(rho, C), rho the product of its tokens' ratios (the unbiased trajectory weight, truncated) or, with ``mean``,
their geometric mean (the per-token-mean log-ratio: trl#5815's question; length does not compound it)."""
from typing import Annotated

from lab.core.settings import Range
from lab.rl.corrections import Correction, register_correction, sequence_log_ratio


@register_correction("sequence-tis")
class SequenceTIS(Correction):
    formula = "min(rho, C), rho = prod_t rho_t (`mean`: (prod_t rho_t)^(1/T))"
    equivalent = ("TRL `sequence_truncate`, `vllm_importance_sampling_clip_max` = C (sum only); verl "
                  "`rollout_is: sequence`, `rollout_is_threshold` = C (sum only)")

    def __init__(self, cap: Annotated[float, Range(ge=1), "C: the largest weight a sequence gets"] = 2.0,
                 mean: Annotated[bool, "the mean of the tokens' log-ratios instead of their sum"] = False):
        self.cap, self.mean = float(cap), mean

    def weigh(self, log_ratio, mask):
        import torch
        rho = torch.clamp(torch.exp(sequence_log_ratio(log_ratio, mask, self.mean)), max=self.cap)
        return rho.expand_as(log_ratio), torch.ones_like(mask)

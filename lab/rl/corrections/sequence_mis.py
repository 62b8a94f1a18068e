"""``sequence-mis``: sequence-level masked importance sampling, every token of a sequence weighted by rho * 1[rho <=
C] (rejected whole above C: "When Speed Kills Stability"), rho the product of the tokens' ratios or, with ``mean``,
their geometric mean (trl#5815: ~100 tokens at a mean log-ratio 0.012 give a product e^1.2, masked at C = 3, and a
geometric mean e^0.012)."""
from typing import Annotated

from lab.core.settings import Range
from lab.rl.corrections import Correction, register_correction, sequence_log_ratio


@register_correction("sequence-mis")
class SequenceMIS(Correction):
    formula = "rho * 1[rho <= C], rho = prod_t rho_t (`mean`: (prod_t rho_t)^(1/T))"
    equivalent = ("TRL `sequence_mask` (its default), `vllm_importance_sampling_clip_max` = C (sum only); verl "
                  "`rollout_is: sequence` with `rollout_rs: seq_sum_k1`")

    def __init__(self, cap: Annotated[float, Range(ge=1), "C: the largest ratio a kept sequence has"] = 3.0,
                 mean: Annotated[bool, "the mean of the tokens' log-ratios instead of their sum"] = False):
        self.cap, self.mean = float(cap), mean

    def weigh(self, log_ratio, mask):
        import torch
        rho = torch.exp(sequence_log_ratio(log_ratio, mask, self.mean))
        keep = rho <= self.cap
        return rho.masked_fill(~keep, 0.0).expand_as(log_ratio), keep.expand_as(mask)


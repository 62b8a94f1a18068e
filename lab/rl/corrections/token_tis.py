"""``token-tis``: token-level truncated importance sampling, each token weighted by min(rho_t, C) (FlashRL, C = 2; the
lab's ``loss: grpo-tis`` is this with C = ``tis_cap``). No lower bound: a token the sampler over-drew is
down-weighted, one it under-drew up-weighted at most C times."""
from typing import Annotated

from lab.core.settings import Range
from lab.rl.corrections import Correction, register_correction


@register_correction("token-tis")
class TokenTIS(Correction):
    formula = "min(rho_t, C)"
    equivalent = ("TRL `token_truncate`, `vllm_importance_sampling_clip_max` = C; verl `rollout_is: token`, "
                  "`rollout_is_threshold` = C")

    def __init__(self, cap: Annotated[float, Range(ge=1), "C: the largest weight a token gets"] = 2.0):
        self.cap = float(cap)

    def weigh(self, log_ratio, mask):
        import torch
        return torch.clamp(torch.exp(log_ratio), max=self.cap), torch.ones_like(mask)

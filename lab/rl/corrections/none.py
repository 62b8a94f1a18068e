"""``none``: no weight; PPO's ratio is taken against the sampler (pi / mu) and clipped to [1 - eps, 1 + eps], so a
token whose mismatch alone puts pi / mu outside the band gets no gradient (the lab's ``loss: grpo``, Oat's and Qi et
al.'s setting)."""
from lab.rl.corrections import Correction, register_correction


@register_correction("none")
class NoCorrection(Correction):
    clip_against = "sampler"
    formula = "1 (PPO's ratio pi / mu, clipped to [1 - eps, 1 + eps])"
    equivalent = "verl bypass mode with `ppo_clip` (pi_old = pi_rollout)"

    def __init__(self):
        pass

    def weigh(self, log_ratio, mask):
        import torch
        return torch.ones_like(log_ratio), torch.ones_like(mask)

"""The source study's advice for RLHF and DPO, as a policy: grow the scale more smoothly and cap it at 65536.

``smooth-capped``: GradScaler's rule (halve on overflow, grow after a run of clean steps) with two changes the source
names, and nothing else: the scale never exceeds ``max_scale`` (2^16), and it grows by ``2^(1/4)`` every 500 clean
steps instead of by 2 every 2000. The growth chosen keeps GradScaler's pace (a doubling per 2000 clean steps) and
changes only its step: a quarter-octave at a time, so that the scale approaches the overflow threshold from below
in steps of 19% rather than jumping past it by 100%. With the pace held, a difference in skipped steps or reward
against `dynamic` is the smoothness's (and the cap's), which is what the source claims (docs/rl.md). The source
gives no public evidence for either; the RL stacks grow faster (verl every 400 steps, DeepSpeed-Chat every 100).
"""
from lab.scaling.policies.warmup import WarmupScaling
from lab.scaling import register


@register("smooth-capped")
class SmoothCapped(WarmupScaling):
    """Dynamic scaling with growth 2^(1/4) per ``growth_interval`` (500) clean steps, halving on overflow, capped at
    ``max_scale`` (2^16), starting at ``init_scale`` (2^16)."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 500, max_scale: float = 2.0**16,
                 growth_factor: float = 2.0 ** 0.25, backoff_factor: float = 0.5):
        super().__init__(init_scale=init_scale, warmup_steps=0, growth_interval=growth_interval, max_scale=max_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor)

"""``amax-predicted``: amax-history's loss scale (lab/scaling/policies/amax.py) from a predicted next amax instead of the
history's largest: the largest power of two ``S`` with ``S * predicted <= 65504 / 2**margin``, where ``predicted``
is any registered predictor (lab/scaling/predictors: max, most_recent, ema, trend, learned) over the last
``history`` observations, most recent first. With ``predictor: max`` it is amax-history step for step
(tests/test_predictors.py). The observations are amax-history's: the unscaled gradients' amax at ``unscale_``, the
least amax that explains an overflow, the largest flushed value for an all-zero step. The prediction runs on the
observations the engine fetches in the step's one host sync already: nothing is added to a step's synchronisation.
"""
from __future__ import annotations

from lab.scaling import register
from lab.scaling.policies.amax import AmaxHistoryScaling, amax_scale, step_observation


@register("amax-predicted")
class AmaxPredicted(AmaxHistoryScaling):
    """Loss scale from a predictor of the next step's gradient amax (module docstring)."""

    def __init__(self, predictor: str | dict = "ema", history: int = 16, margin: int = 3,
                 init_scale: float = 1024.0, min_scale: float = 2.0**-24, max_scale: float = 2.0**24):
        super().__init__(history=history, margin=margin, init_scale=init_scale, min_scale=min_scale,
                         max_scale=max_scale)
        from lab.scaling.predictors import create_predictor
        try:
            self.predictor = create_predictor(predictor, history="fp16")
        except ValueError as e:
            raise self._err(str(e)) from None

    def update(self, scale, found_inf, step, grad_norm=None, grad_amax=None):
        if grad_amax is None and not found_inf:
            raise self._err("update() needs grad_amax (the engine passes it: build the scaler with "
                            "lab.scaling.create('amax-predicted'))")
        import torch
        self._amaxes.append(step_observation(scale, found_inf, grad_amax, self.margin))
        window = torch.tensor(list(reversed(self._amaxes)), dtype=torch.float64)  # most recent first
        return amax_scale(float(self.predictor(window)), self.margin, self.min_scale, self.max_scale)

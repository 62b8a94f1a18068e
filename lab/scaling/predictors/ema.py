"""``ema``: an exponential moving average of log2 amax (weight ``decay^age`` over the observed steps) plus ``k``
moving deviations above it (ColossalAI#6105 proposes the average; the deviations make it an upper bound). Follows
a drift within ~1/(1-decay) steps; a rise faster than k deviations per step clips."""
from typing import Annotated

from lab.core.settings import Range
from lab.scaling.predictors import Predictor, latest_observed, register_predictor


@register_predictor("ema")
class Ema(Predictor):
    def __init__(self, decay: Annotated[float, Range(gt=0, lt=1)] = 0.9, k: Annotated[float, Range(ge=0)] = 3.0):
        self.decay, self.k = float(decay), float(k)

    def predict(self, amax, observed):
        import torch
        log2 = torch.log2(amax)
        ages = torch.arange(amax.shape[-1], device=amax.device, dtype=amax.dtype)
        # ages counted from the latest observed step: its weight is 1, so the weights never all underflow to 0 (a
        # history observed only 1000 steps back: decay^1000 is 0 in FP32, and 0/0 NaN)
        latest = latest_observed(observed).to(amax.dtype)
        w = torch.pow(self.decay, (ages - latest).clamp(min=0)) * observed  # newer ones: unobserved, weight 0
        w = w / w.sum(-1, keepdim=True)
        mean = (w * log2).sum(-1)
        sd = (w * (log2 - mean.unsqueeze(-1)) ** 2).sum(-1).sqrt()
        return torch.exp2(mean + self.k * sd)

"""``trend``: the least-squares line through the last ``n`` observed log2 amaxes, extrapolated one step, plus ``k``
standard deviations of its residuals. Follows a steady rise or fall (a shrinking gradient, a warming learning
rate) where max lags and most_recent clips; a spike bends the line for n steps."""
from typing import Annotated

from lab.core.settings import Range
from lab.scaling.predictors import Predictor, register_predictor


@register_predictor("trend")
class Trend(Predictor):
    def __init__(self, n: Annotated[int, Range(ge=2)] = 8, k: Annotated[float, Range(ge=0)] = 2.0):
        self.n, self.k = int(n), float(k)

    def predict(self, amax, observed):
        import torch
        # the n most recent observed steps (a run of unobserved ones skipped, its gap kept in their ages): the
        # positions sorted observed first, then by age; a fully observed history's first n, as they stand
        length = amax.shape[-1]
        ages = torch.arange(length, device=amax.device, dtype=amax.dtype)
        pos = torch.where(observed, ages, ages + length).topk(min(self.n, length), -1, largest=False).indices
        log2, seen = torch.log2(amax.gather(-1, pos)), observed.gather(-1, pos).to(amax.dtype)
        age = pos.to(amax.dtype)
        count = seen.sum(-1)
        mean_age = (seen * age).sum(-1) / count
        mean = (seen * log2).sum(-1) / count
        da, dl = age - mean_age.unsqueeze(-1), log2 - mean.unsqueeze(-1)
        var_age = (seen * da * da).sum(-1)
        slope = torch.where(var_age > 0, (seen * da * dl).sum(-1) / var_age.clamp(min=1e-30),
                            torch.zeros_like(mean))
        residual = seen * (dl - slope.unsqueeze(-1) * da)
        sd = ((residual ** 2).sum(-1) / (count - 2).clamp(min=1)).sqrt()
        # the line at age -1 (the next step); one observation: that value, no spread
        return torch.exp2(mean + slope * (-1.0 - mean_age) + self.k * sd)

"""``max``: Transformer Engine's ``amax_compute_algo="max"``: the largest amax of the history (its zeros, the
steps not yet observed, passed over as TE's maximum passes them). Safe while the amax shrinks or holds; after a
spike it keeps the scale down for the whole history; a rise beyond every past amax clips. An inf or NaN amax is
passed over too: TE's CUDA maximum passes over a NaN as well, but an inf makes its maximum inf and its scale stay
where it was for the whole history, where this one goes on from the finite amaxes (docs/controllers.md)."""
from lab.scaling.predictors import Predictor, register_predictor


@register_predictor("max")
class Max(Predictor):
    def __init__(self):
        pass

    def predict(self, amax, observed):
        import torch
        return torch.where(observed, amax, torch.zeros_like(amax)).amax(-1)

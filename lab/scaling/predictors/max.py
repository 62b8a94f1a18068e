"""``max``: Transformer Engine's ``amax_compute_algo="max"``: the largest amax of the history (its zeros, the
steps not yet observed, passed over as TE's maximum passes them). Safe while the amax shrinks or holds; after a
spike it keeps the scale down for the whole history; a rise beyond every past amax clips. A NaN amax is passed over
as TE's CUDA maximum (fmaxf) passes over it; an inf one makes TE's maximum inf, so TE keeps its scale while the inf
is in the history: this one then predicts nothing (0), and the caller keeps its scale too (docs/controllers.md)."""
from lab.scaling.predictors import Predictor, register_predictor


@register_predictor("max")
class Max(Predictor):
    inf_keeps_scale = True

    def __init__(self):
        pass

    def predict(self, amax, observed):
        import torch
        return torch.where(observed, amax, torch.zeros_like(amax)).amax(-1)

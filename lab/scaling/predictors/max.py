"""``max``: Transformer Engine's ``amax_compute_algo="max"``: the largest amax of the history (its zeros, the
steps not yet observed, included, as TE's history starts at zero). Safe while the amax shrinks or holds; after a
spike it keeps the scale down for the whole history; a rise beyond every past amax clips."""
from lab.scaling.predictors import Predictor, register_predictor


@register_predictor("max")
class Max(Predictor):
    def __init__(self):
        pass

    def __call__(self, history):
        return history.amax(-1)  # TE's exact rule: NaN propagates, an all-zero history gives 0 (scale 1)

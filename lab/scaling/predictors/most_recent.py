"""``most_recent``: Transformer Engine's ``amax_compute_algo="most_recent"``: the last step's amax. Tracks a
shrinking amax at once; any step that rises above the one before clips. A last step with nothing observed (amax 0,
inf or NaN) gives the latest observed one: the amax TE's scale then stays at, as TE keeps its scale."""
from lab.scaling.predictors import Predictor, latest_observed, register_predictor


@register_predictor("most_recent")
class MostRecent(Predictor):
    def __init__(self):
        pass

    def predict(self, amax, observed):
        return amax.gather(-1, latest_observed(observed)).squeeze(-1)

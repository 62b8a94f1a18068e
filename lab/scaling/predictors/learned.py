"""``learned``: a quantile model fitted to recorded histories (lab/scaling/learning/fit.py): the next step's log2
amax as the most recent one plus a linear function of the history's scale-free features (features.py), fitted at
an upper quantile q, so that the next amax exceeds the prediction with probability about 1 - q on histories like
those it learned from. ``model``: the fitted artefact (`auto`: the lab's committed one for this kind of history,
results/controllers/models/learned-fp16.json or learned-fp8.json). Fails where no history it saw foresaw the step: a
spike out of a flat history clips as under every other rule.

A model file that does not exist yet (a study's fit rule writes it before the runs that use it) is looked up again
at the first prediction, which fails there, naming where it looked."""
from lab.scaling.predictors import Predictor, register_predictor


@register_predictor("learned")
class Learned(Predictor):
    def __init__(self, model: str = "auto"):
        self.model = model
        self._coef, self._on = None, None
        self._load(missing_ok=True)

    def _load(self, missing_ok: bool = False) -> None:
        from lab.scaling.learning import artefact
        from lab.scaling.learning.features import FEATURES
        try:
            fitted = artefact.load(self.model, f"learned-{self.history}", "quantile-linear", FEATURES, len(FEATURES),
                                   missing_ok=missing_ok)
        except artefact.MissingModel:
            raise
        except ValueError as e:
            raise self._err(str(e)) from None
        if fitted is not None:
            self._coef = fitted["coef"]

    def predict(self, amax, observed):
        import torch
        from lab.scaling.learning.features import features
        if self._coef is None:
            self._load()
        if self._on is None or self._on.device != amax.device or self._on.dtype != amax.dtype:
            self._on = torch.tensor(self._coef, dtype=amax.dtype, device=amax.device)
        f, last = features(amax, observed)
        # an elementwise product summed over the last dimension, not a matrix product: every history's prediction is
        # the same bits whether it is predicted alone or in a batch (a GEMV's order depends on the batch)
        return torch.exp2(last + (f * self._on).sum(-1))

"""``rl-controller``: the loss-scale controller learned by reinforcement learning in the replay
(lab/scaling/learning/controller.py), frozen: each step it observes what amax-history observes (the unscaled
gradients' amax, or the least amax that explains an overflow) and halves, holds or doubles the scale, taking its
most probable action. ``model``: the fitted artefact (``auto``: results/controllers/models/rl-fp16.json, fitted by
``lab fit-controller --controller rl``); ``init_scale``: its first scale (1024, what it learned from: amax-history's)."""
from __future__ import annotations

from typing import Any

from lab.scaling import ScalingPolicy, register


@register("rl-controller")
class RlController(ScalingPolicy):
    """The frozen RL controller (module docstring)."""

    needs_grad_amax = True

    def __init__(self, model: str = "auto", init_scale: float = 1024.0):
        self.model = model
        self.init_scale = self.check_positive("init_scale", init_scale)
        self._fitted = self._state = self._weights = None
        self._load(missing_ok=True)  # a study's fit rule may write it after validation, before the runs

    def _load(self, missing_ok: bool = False) -> None:
        from lab.scaling.learning import artefact
        from lab.scaling.learning.controller import ACTIONS, FEATURES
        try:
            self._fitted = artefact.load(self.model, "rl-fp16", "rl-linear", FEATURES, len(ACTIONS) * len(FEATURES),
                                         missing_ok=missing_ok)
        except artefact.MissingModel:
            raise
        except ValueError as e:
            raise self._err(str(e)) from None

    def _ready(self):
        if self._weights is None:
            if self._fitted is None:
                self._load()
            import torch
            from lab.scaling.learning.controller import ACTIONS, ControllerState
            self._weights = torch.tensor(self._fitted["coef"], dtype=torch.float64).reshape(len(ACTIONS), -1)
            self._state = self._state or ControllerState()

    def update(self, scale, found_inf, step, grad_norm=None, grad_amax=None):
        import torch
        from lab.scaling.learning.controller import next_scale
        self._ready()
        self._state.observe(scale, found_inf, grad_amax if grad_amax is not None else float("inf"))
        return next_scale(scale, int(torch.argmax(self._weights @ self._state.features(scale))))

    def state_dict(self) -> dict[str, Any]:
        s = self._state
        return {} if s is None else {"window": list(s.window), "overflowed": s.overflowed, "since": s.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "window" not in state:
            return
        from lab.scaling.learning.controller import ControllerState
        self._state = ControllerState()
        self._state.window.extend(float(a) for a in state["window"])
        self._state.overflowed, self._state.since = bool(state["overflowed"]), int(state["since"])

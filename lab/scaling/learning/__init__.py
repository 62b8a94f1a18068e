"""Scales learned from recorded runs: the features a learned predictor reads (features.py), the amax histories the
runs recorded (histories.py), fitting a quantile model to them (fit.py), the fitted artefact (artefact.py), judging
every predictor over held-out histories (judge.py) and the reinforcement-learning controller trained in the replay
(controller.py). docs/controllers.md."""

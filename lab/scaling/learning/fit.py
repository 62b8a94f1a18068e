"""Fitting the learned predictor: linear quantile regression of the next step's log2 amax change on the history's
features (features.py), solved exactly as a linear program (scipy's HiGHS), not by iteration:

    minimise  sum_i  q * u_i + (1 - q) * v_i   subject to  X_i . beta + u_i - v_i = y_i,  u, v >= 0

whose solution puts about a share q of the training targets at or under the fitted line (the pinball loss's
minimiser). q is the stated chance that a step's amax stays within its prediction: 0.99 clips about one step in
a hundred on histories like the training ones, before any margin.
"""
from __future__ import annotations

import numpy as np
import torch

from lab.scaling.learning.features import FEATURES, features, windows

#: at most this many samples enter the program (every k-th, in order): the fit's time stays ~seconds
MAX_SAMPLES = 20000


def samples(sequences: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(X (N, len(FEATURES)), y (N,)) from recorded amax sequences (each oldest first)."""
    xs, ys = [], []
    for seq in sequences:
        amax, observed, target = windows(seq)
        if len(target):
            f, _ = features(amax, observed)
            xs.append(f.numpy())
            ys.append(target.numpy())
    if not xs:
        return np.zeros((0, len(FEATURES))), np.zeros(0)
    return np.concatenate(xs), np.concatenate(ys)


def quantile_fit(x: np.ndarray, y: np.ndarray, quantile: float) -> np.ndarray:
    """beta minimising the pinball loss at ``quantile`` (the module docstring's program)."""
    from scipy import sparse
    from scipy.optimize import linprog
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
    n, p = x.shape
    if n < 2 * p:
        raise ValueError(f"{n} samples cannot fit {p} coefficients: record longer or more runs")
    if n > MAX_SAMPLES:
        keep = np.linspace(0, n - 1, MAX_SAMPLES).round().astype(int)
        x, y, n = x[keep], y[keep], MAX_SAMPLES
    eye = sparse.identity(n, format="csr")
    a_eq = sparse.hstack([sparse.csr_matrix(x), eye, -eye], format="csr")
    cost = np.concatenate([np.zeros(p), np.full(n, quantile), np.full(n, 1.0 - quantile)])
    bounds = [(None, None)] * p + [(0, None)] * (2 * n)
    res = linprog(cost, A_eq=a_eq, b_eq=y, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"quantile regression failed: {res.message}")
    return res.x[:p]


def pinball(x: np.ndarray, y: np.ndarray, beta: np.ndarray, quantile: float) -> float:
    r = y - x @ beta
    return float(np.mean(np.maximum(quantile * r, (quantile - 1.0) * r)))

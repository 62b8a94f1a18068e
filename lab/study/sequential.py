"""Group-sequential plans: adding seeds after a look, at a declared error rate.

A family whose seeds may grow after an interim look (the LM went 3 -> 6 seeds after a look) declares its plan
before the runs, in the claims file::

    sequential:
      lm: {looks: [3, 6], spending: obrien-fleming}

`looks` are the seed counts at which the claims are analysed, the last one the most the family will get; the
error rate 5% is spent over them by a Lan–DeMets spending function (``obrien-fleming``: almost nothing early,
nearly the whole 5% at the last look; ``pocock``: evenly). At look k, a test on that family is decided at the
nominal two-sided level :func:`nominal_levels` gives, so that over every look together the chance of a false
decision stays at 5%. The boundaries come from the exact recursion of Armitage, McPherson and Rowe (1969) for the
joint distribution of the test statistics at the looks (information = seeds), computed on a grid: deterministic,
and checked against Jennison and Turnbull's published values (tests/test_sequential.py).
"""
from __future__ import annotations

import math

import numpy as np
from scipy import optimize, stats as st

__all__ = ["SPENDING", "spent", "boundaries", "nominal_levels", "look_level", "SequentialError"]

GRID = 1001   # points of the continuation region's grid in the recursion (6 digits of the boundaries)


class SequentialError(ValueError):
    """A plan that cannot be applied (bad looks, unknown spending, seeds in hand that are not a look)."""


def _obrien_fleming(t: float, alpha: float) -> float:
    return 2 - 2 * st.norm.cdf(st.norm.ppf(1 - alpha / 2) / math.sqrt(t))


def _pocock(t: float, alpha: float) -> float:
    return alpha * math.log(1 + (math.e - 1) * t)


SPENDING = {"obrien-fleming": _obrien_fleming, "pocock": _pocock}


def spent(t: float, alpha: float, spending: str) -> float:
    """The error rate spent by information fraction t (0 < t <= 1)."""
    if spending not in SPENDING:
        raise SequentialError(f"unknown spending {spending!r}; known: {', '.join(SPENDING)}")
    return SPENDING[spending](t, alpha)


def boundaries(looks: list[int], alpha: float = 0.05, spending: str = "obrien-fleming") -> list[float]:
    """Two-sided z boundaries at each look (seeds in hand; information fraction looks[k] / looks[-1])."""
    if not looks or any(not isinstance(n, int) or n < 2 for n in looks) or list(looks) != sorted(set(looks)):
        raise SequentialError(f"looks must be increasing seed counts >= 2, got {looks!r}")
    t = [n / looks[-1] for n in looks]
    z = [float(st.norm.ppf(1 - spent(t[0], alpha, spending) / 2))]
    # the density of the score S_k (variance t_k) over the continuation region |S_k| < z_k sqrt(t_k)
    grid = np.linspace(-z[0] * math.sqrt(t[0]), z[0] * math.sqrt(t[0]), GRID)
    dens = st.norm.pdf(grid, scale=math.sqrt(t[0]))
    for k in range(1, len(t)):
        step = math.sqrt(t[k] - t[k - 1])
        weights = dens * _trapezoid(grid)
        target = spent(t[k], alpha, spending) - spent(t[k - 1], alpha, spending)

        def crossing(c: float) -> float:
            b = c * math.sqrt(t[k])
            out = st.norm.cdf((-b - grid) / step) + st.norm.sf((b - grid) / step)
            return float(weights @ out)
        c = optimize.brentq(lambda c: crossing(c) - target, 0.1, 20.0, xtol=1e-10)
        z.append(c)
        nxt = np.linspace(-c * math.sqrt(t[k]), c * math.sqrt(t[k]), GRID)
        dens = (st.norm.pdf((nxt[:, None] - grid[None, :]) / step) / step) @ weights
        grid = nxt
    return z


def _trapezoid(grid: np.ndarray) -> np.ndarray:
    w = np.full(len(grid), grid[1] - grid[0])
    w[0] = w[-1] = w[0] / 2
    return w


def nominal_levels(looks: list[int], alpha: float = 0.05, spending: str = "obrien-fleming") -> list[float]:
    """The two-sided p-value each look's test must reach: 2 (1 − Φ(z_k))."""
    return [float(2 * st.norm.sf(z)) for z in boundaries(looks, alpha, spending)]


def look_level(plan: dict, seeds: int, alpha: float = 0.05) -> tuple[float, int]:
    """(nominal two-sided level, look number from 1) of a family's plan at ``seeds`` seeds in hand: the last look
    reached (seeds between looks are analysed at the look before them: more seeds than planned spend nothing
    more; fewer than the first look: its level)."""
    looks = list(plan["looks"])
    if seeds > looks[-1]:
        raise SequentialError(f"{seeds} seeds in hand, more than the plan's last look ({looks[-1]}): the plan "
                              "cannot cover them; declare a plan with a later look before adding them")
    k = max([i for i, n in enumerate(looks) if n <= seeds], default=0)
    return nominal_levels(looks, alpha, plan.get("spending", "obrien-fleming"))[k], k + 1

"""Group-sequential plans (lab/study/sequential.py): the boundaries against a simulation of the test statistics at
the looks (the mathematics, not another implementation), the first look against the spending function in closed
form, and a plan applied by `lab claims`."""
import math

import numpy as np
import pytest
from scipy import stats as st

from lab.study import sequential as Q


@pytest.mark.parametrize("looks, spending", [([3, 6], "obrien-fleming"), ([2, 4, 6, 8, 10], "obrien-fleming"),
                                              ([2, 4, 6, 8, 10], "pocock"), ([3, 5, 6], "pocock")])
def test_each_look_spends_what_the_spending_function_allows(looks, spending):
    """Z at look k is a Brownian motion at information t_k over sqrt(t_k): simulated 400,000 times, the share that
    first crosses at each look is the spending function's increment (within 4 Monte Carlo standard errors)."""
    z = Q.boundaries(looks, 0.05, spending)
    t = np.array(looks) / looks[-1]
    rng = np.random.default_rng(0)
    n = 400_000
    s = np.cumsum(rng.normal(size=(n, len(t))) * np.sqrt(np.diff(t, prepend=0.0)), axis=1)
    crossed = np.abs(s / np.sqrt(t)) >= np.array(z)
    first = np.where(crossed.any(1), crossed.argmax(1), -1)
    prev = 0.0
    for k in range(len(t)):
        want = Q.spent(t[k], 0.05, spending) - prev
        prev += want
        got = float(np.mean(first == k))
        assert got == pytest.approx(want, abs=4 * math.sqrt(want * (1 - want) / n) + 1e-6), (k, got, want)
    assert float(np.mean(first >= 0)) == pytest.approx(0.05, abs=4 * math.sqrt(0.05 * 0.95 / n))
    # the first look in closed form: its whole increment is a two-sided normal tail
    assert 2 * st.norm.sf(z[0]) == pytest.approx(Q.spent(t[0], 0.05, spending), rel=1e-9)


def test_a_plan_at_its_last_look_and_off_the_plan():
    plan = {"looks": [3, 6], "spending": "obrien-fleming"}
    level, look = Q.look_level(plan, 6)
    assert look == 2 and 0.04 < level < 0.05          # nearly all of 5% left for the last look
    assert Q.look_level(plan, 4)[1] == 1               # between looks: the look before
    with pytest.raises(Q.SequentialError, match="more than the plan's last look"):
        Q.look_level(plan, 7)
    with pytest.raises(Q.SequentialError, match="increasing seed counts"):
        Q.boundaries([6, 3])

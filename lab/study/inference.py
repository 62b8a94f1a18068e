"""The study's verdict procedure: a mode against FP32 on the same seeds and the same validation examples.

Two sources of variance make a measured difference Δ = mode − FP32 uncertain (docs/statistics.md):

* the **seeds**: another seed (or another machine's accumulation order) gives another trajectory. Its variance is
  estimated from the whole family at once: a model with mode and seed effects (two-way ANOVA, what statsmodels'
  OLS ``y ~ C(mode) + C(seed)`` fits on a complete table) pools the residual spread of every mode whose spread is
  comparable, (K − 1)(S − 1) degrees of freedom instead of the S − 1 of one pair. A mode whose own spread is far
  larger (a one-sided F test against the others, Bonferroni over the modes) is taken out of the pool and gets its
  own spread, with its own S − 1 degrees of freedom;
* the **examples**: the validation set is a sample too (360 images; the LM's 24 documents). Its variance is that
  of the per-unit differences, averaged over seeds, over the number of independent units (images; documents for
  the LM, a ratio estimator linearised: the token-weighted mean of a document's losses).

The interval's variance is that of the crossed design: the seeds' var(Δ)/S, which already holds each run's
example noise, plus the part of the examples' variance every seed shares (the mode × example interaction: the
covariance of the per-unit Δs between seeds, over the units), on Satterthwaite's degrees of freedom capped at the
seeds' (calibrated: lab/study/calibration.py). Without per-seed example outcomes, the examples' whole variance is
added on the seeds' degrees of freedom (conservative). No verdict rests on a
seed spread of zero or near zero: runs that are identical in every seed and example are "identical"; otherwise a
zero spread leaves the cell "not resolved" (two seeds that differ by the same whole number of images say nothing
about the next seed).

Verdicts against the declared equivalence margin m (configs/claims.yaml): a difference is *resolved* when the
two-sided test of Δ = 0 survives the table's multiplicity control, *equivalent* when TOST (two one-sided tests at
α, the (1 − 2α) interval inside ±m) survives it; resolved and equivalent is **negligible**, resolved only is a
**cost** or **gain**, equivalent only is **equivalent**, neither is **not resolved**. A diverged run is a result:
its non-finite losses count as a uniform guess (ln C nats) and its accuracy as measured.

Everything here works on arrays (no pandas), so the calibration simulation (tests/test_calibration.py) runs the
same code as the study thousands of times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats as st

#: a seed spread at or below this fraction of the metric's typical size is "zero" (rounding: 7e-16 is not a spread)
ZERO_SPREAD = 1e-9
#: one-sided level of the F test that takes a mode with a much larger spread out of the pool (Bonferroni over modes)
SPREAD_TEST_LEVEL = 0.05
#: paired seeds a mode needs before it may join the family's pooled spread (calibrated: lab/study/calibration_runs.py)
MIN_SEEDS_TO_POOL = 4


@dataclass
class Paired:
    """One mode against the reference over S shared seeds, for one metric.

    ``seed_delta`` (S,): the run-level Δ per seed. ``unit_delta`` (U,): per independent unit, the Δ averaged over
    seeds, as the unit's share of the run-level Δ (for a ratio estimator: A_u − Δ·T_u over mean T, see
    `unit_shares`); None when the runs have no per-example outcomes. ``identical``: every seed's runs gave the same
    outcome on every example."""
    seed_delta: np.ndarray
    unit_delta: np.ndarray | None = None
    identical: bool = False
    n_diverged: int = 0
    fixed_var: float = math.nan   # the examples' part every seed shares (fixed_example_variance); NaN: unknown


@dataclass
class Cell:
    """The decision quantities of one (family, mode, metric) comparison."""
    delta: float = math.nan
    se: float = math.nan
    df: float = math.nan
    se_seed: float = math.nan
    se_example: float = math.nan
    spread: str = "none"       # pooled | own | zero | identical | none
    n_pairs: int = 0
    n_units: int = 0
    p_diff: float = math.nan   # two-sided, Δ = 0
    p_tost: float = math.nan   # max of the two one-sided tests against ±margin
    margin: float = math.nan
    note: str = ""
    n_diverged: int = 0
    extra: dict = field(default_factory=dict)

    def half_width(self, confidence: float) -> float:
        if not (math.isfinite(self.se) and math.isfinite(self.df) and self.df > 0):
            return math.nan
        return float(st.t.ppf(0.5 + confidence / 2, self.df) * self.se)

    @property
    def decidable(self) -> bool:
        return self.spread in ("pooled", "own") and math.isfinite(self.se) and self.se > 0


# --- the example component --------------------------------------------------------------------------------------
def unit_shares(per_example_delta: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Per independent unit u, its linearised contribution to the mean Δ: (A_u − Δ̄·T_u) / T̄, where A_u is the
    sum of the unit's example deltas, T_u its example count, Δ̄ the overall mean and T̄ the mean count. For units
    of one example each this is d_u − Δ̄: the variance of the mean is var(shares)/U either way."""
    d = np.asarray(per_example_delta, float)
    unit = np.asarray(unit)
    t = np.bincount(unit) if unit.dtype.kind in "iu" and len(unit) and unit.min() >= 0 else None
    if t is not None and t.all():  # units already numbered 0..U-1 (every run's outcomes.npz): no sort needed
        idx = unit
    else:
        _, idx = np.unique(unit, return_inverse=True)
        t = np.bincount(idx)
    a = np.bincount(idx, weights=d)
    t = t.astype(float)
    mean = a.sum() / t.sum()
    return (a - mean * t) / t.mean()


def fixed_example_variance(per_seed_shares: list) -> float:
    """The part of the examples' variance that more seeds would not remove: the covariance of the per-unit shares
    between different seeds (what the test set's units do to every seed alike), over U; 0 when negative."""
    if len(per_seed_shares) < 2:
        return math.nan
    u = len(per_seed_shares[0])
    covs = [float(np.dot(a, b)) / (u - 1) for i, a in enumerate(per_seed_shares) for b in per_seed_shares[i + 1:]]
    return max(float(np.mean(covs)), 0.0) / u


def example_variance(shares: np.ndarray | None) -> tuple[float, int]:
    """(variance of the mean Δ from sampling the units, units): var(shares, ddof 1) / U."""
    if shares is None or len(shares) < 2:
        return math.nan, 0 if shares is None else len(shares)
    return float(np.var(shares, ddof=1) / len(shares)), len(shares)


# --- the seed component -----------------------------------------------------------------------------------------
def anova_residual(table: np.ndarray) -> tuple[float, int]:
    """(residual variance, degrees of freedom) of y = mode + seed + ε on a complete K × S table (rows: modes)."""
    k, s = table.shape
    if k < 2 or s < 2:
        return math.nan, 0
    r = table - table.mean(1, keepdims=True) - table.mean(0, keepdims=True) + table.mean()
    df = (k - 1) * (s - 1)
    return float((r ** 2).sum() / df), df


def larger_spread_modes(seed_deltas: dict, level: float = SPREAD_TEST_LEVEL) -> set:
    """Modes whose Δ spread over seeds is larger than the others' (one-sided F test of var(Δ_m) against the pooled
    var of the rest, Bonferroni over the modes tested), removed one at a time, largest first."""
    var = {m: float(np.var(d, ddof=1)) for m, d in seed_deltas.items() if len(d) >= 2}
    flagged: set = set()
    while len(var) - len(flagged) >= 3:
        rest = [m for m in var if m not in flagged]
        worst = max(rest, key=lambda m: var[m])
        others = [m for m in rest if m != worst]
        df1 = len(seed_deltas[worst]) - 1
        df2 = sum(len(seed_deltas[m]) - 1 for m in others)
        pool = sum(var[m] * (len(seed_deltas[m]) - 1) for m in others) / df2
        if pool <= 0:
            p = 0.0 if var[worst] > 0 else 1.0
        else:
            p = float(st.f.sf(var[worst] / pool, df1, df2))
        if p * len(rest) >= level:
            break
        flagged.add(worst)
    return flagged


def seed_spread(values: dict, reference: str) -> tuple[dict, float, int, set]:
    """The family's seed spread. ``values``: {mode: {seed: value}} (reference included).

    Returns ({mode: seed Δs over the seeds it shares with the reference}, pooled var(Δ) = 2σ², its degrees of
    freedom, the modes with their own spread). The pool is the two-way residual over the reference and the
    comparable modes, on the seeds all of them share."""
    ref = values.get(reference, {})
    deltas = {}
    for m, by_seed in values.items():
        if m == reference:
            continue
        seeds = sorted(set(by_seed) & set(ref))
        deltas[m] = np.array([by_seed[s] - ref[s] for s in seeds], float)
    # a mode joins the pool only where its own spread could be told from the others': below MIN_SEEDS_TO_POOL seeds
    # the F test cannot see even a 10x wider mode (through the study's commands, such a mode pooled at 2 seeds
    # reached p <= 0.05 in 19% of null cells), so it keeps its own spread, on its own S - 1 degrees of freedom
    own = larger_spread_modes(deltas) | {m for m, d in deltas.items() if len(d) < MIN_SEEDS_TO_POOL}
    pooled_modes = [m for m in deltas if m not in own and len(deltas[m]) >= 2]
    seeds = sorted(set(ref).intersection(*(values[m] for m in pooled_modes))) if pooled_modes else []
    if len(seeds) < 2:
        return deltas, math.nan, 0, own
    table = np.array([[values[m][s] for s in seeds] for m in [reference, *pooled_modes]], float)
    var, df = anova_residual(table)
    return deltas, 2 * var, df, own


def zero_spread(var_delta: float, scale: float) -> bool:
    """The guard: a seed spread at or below ZERO_SPREAD of the metric's size is no spread (ties, rounding)."""
    return var_delta <= (ZERO_SPREAD * scale) ** 2


# --- one comparison ---------------------------------------------------------------------------------------------
def _scale_of(values: dict) -> float:
    """A metric's typical size, for what counts as a zero spread."""
    flat = [abs(v) for by_seed in values.values() for v in by_seed.values() if math.isfinite(v)]
    return max(float(np.mean(flat)) if flat else 1.0, 1e-12)


def decide_cell(paired: Paired, var_delta: float, df_seed: float, spread: str, margin: float,
                scale: float = 1.0) -> Cell:
    """Δ, its standard error and the two p-values of one cell. ``var_delta``: the variance of one seed's Δ (pooled
    2σ², or the mode's own), ``df_seed`` its degrees of freedom, ``spread`` 'pooled' or 'own'."""
    d = np.asarray(paired.seed_delta, float)
    s = len(d)
    cell = Cell(delta=float(d.mean()) if s else math.nan, n_pairs=s, margin=margin, n_diverged=paired.n_diverged,
                extra={"var_delta": var_delta, "df_seed": df_seed})  # what sizing reads
    if s == 0:
        cell.note = "no shared seeds"
        return cell
    if paired.identical:
        cell.spread, cell.se, cell.note = "identical", 0.0, "identical outcomes on every seed and example"
        return cell
    if s < 2 or not math.isfinite(var_delta) or df_seed < 1:
        cell.note = f"{s} pair(s): no seed spread"
        return cell
    if zero_spread(var_delta, scale):
        cell.spread = "zero"
        cell.note = (f"the seeds' Δs do not vary (sd {math.sqrt(max(var_delta, 0)):.2g}): no spread to decide on; "
                     "more seeds")
        return cell
    v_seed = var_delta / s
    v_ex, units = example_variance(paired.unit_delta)
    cell.n_units = units
    if not math.isfinite(v_ex):
        v_ex = 0.0
    if math.isfinite(paired.fixed_var) and units >= 2:
        # the crossed design (seed, example, mode x example): each seed's run-level Δ already holds the examples'
        # noise of that run, so only the part every seed shares (the mode x example interaction) is added, with
        # Satterthwaite's degrees of freedom for the sum (the seeds': df_seed; the units': U - 1)
        v_fix = paired.fixed_var
        v = v_seed + v_fix
        den = v_seed ** 2 / df_seed + v_fix ** 2 / (units - 1)
        cell.df = float(min(v ** 2 / den, df_seed)) if v > 0 and den > 0 else float(df_seed)
        v_ex = v_fix
    else:
        # no per-seed example outcomes: the examples' whole variance added on the seeds' degrees of freedom
        # (conservative: it counts the seed x example part twice)
        v = v_seed + v_ex
        cell.df = float(df_seed)
    cell.se, cell.se_seed, cell.se_example, cell.spread = math.sqrt(v), math.sqrt(v_seed), math.sqrt(v_ex), spread
    if cell.se == 0:  # reachable only without the zero-spread guard above: a point mass decides everything
        cell.p_diff = 0.0 if cell.delta != 0 else 1.0
        cell.p_tost = 0.0 if math.isfinite(margin) and abs(cell.delta) < margin else math.nan
        return cell
    t = cell.delta / cell.se
    cell.p_diff = float(2 * st.t.sf(abs(t), cell.df))
    if math.isfinite(margin) and margin > 0:
        p_lo = st.t.sf((cell.delta + margin) / cell.se, cell.df)   # H0: Δ ≤ −m
        p_hi = st.t.cdf((cell.delta - margin) / cell.se, cell.df)  # H0: Δ ≥ +m
        cell.p_tost = float(max(p_lo, p_hi))
    return cell


def family_cells(values: dict, units: dict, reference: str, margin: float) -> dict:
    """Every mode of one family and metric against the reference. ``values``: {mode: {seed: run-level value}};
    ``units``: {mode: Paired-building input} as {mode: (unit shares or None, identical, n_diverged)}.
    Returns {mode: Cell}."""
    deltas, var_pool, df_pool, own = seed_spread(values, reference)
    scale = _scale_of(values)
    cells = {}
    for m, d in deltas.items():
        entry = units.get(m, (None, False, 0))
        shares, identical, n_div = entry[:3]
        p = Paired(d, shares, identical, n_div, entry[3] if len(entry) > 3 else math.nan)
        if m in own:
            cells[m] = decide_cell(p, float(np.var(d, ddof=1)), len(d) - 1, "own", margin, scale)
            cells[m].note = cells[m].note or "its spread is larger than the family's: its own"
        else:
            cells[m] = decide_cell(p, var_pool, df_pool, "pooled", margin, scale)
    return cells


# --- multiplicity -----------------------------------------------------------------------------------------------
def _adjusted(p, method: str) -> np.ndarray:
    """statsmodels' multipletests adjusted p-values over the finite entries; NaN stays NaN and is not counted."""
    p = np.asarray(p, float)
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        from statsmodels.stats.multitest import multipletests
        out[ok] = multipletests(p[ok], method=method)[1]
    return out


def bh_adjust(p: np.ndarray) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (q-values: false discovery rate)."""
    return _adjusted(p, "fdr_bh")


def holm_adjust(p: np.ndarray) -> np.ndarray:
    """Holm adjusted p-values (family-wise error) over the finite entries; NaN stays NaN and is not counted.

    The step-down written out (what statsmodels' multipletests(method="holm") returns, tests/test_rl_claims.py):
    multipletests calls gc.collect() on every call, tens of milliseconds in a large process, which the claims'
    calibration simulation would pay thousands of times."""
    p = np.asarray(p, float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m, running = len(ok), 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def verdict(cell: Cell, q_diff: float, q_tost: float, alpha: float, higher_is_better: bool) -> str:
    """identical / negligible / cost / gain / equivalent / not resolved, from the adjusted p-values."""
    if cell.spread == "identical":
        return "identical"
    resolved = math.isfinite(q_diff) and q_diff <= alpha
    equivalent = math.isfinite(q_tost) and q_tost <= alpha
    if resolved and equivalent:
        return "negligible"
    if resolved:
        return "gain" if (cell.delta > 0) == higher_is_better else "cost"
    return "equivalent" if equivalent else "not resolved"


def decide_table(cells: list[Cell], alpha: float, higher_is_better: list[bool]) -> list[tuple[str, float, float]]:
    """Verdicts for a whole table's cells under Benjamini–Hochberg at ``alpha`` (false discovery rate), applied to
    the difference tests and, separately, to the equivalence tests: [(verdict, q_diff, q_tost)]."""
    q_diff = bh_adjust(np.array([c.p_diff for c in cells]))
    q_tost = bh_adjust(np.array([c.p_tost for c in cells]))
    return [(verdict(c, qd, qt, alpha, hib), float(qd), float(qt))
            for c, qd, qt, hib in zip(cells, q_diff, q_tost, higher_is_better)]


# --- sizing -----------------------------------------------------------------------------------------------------
def sd_upper(var: float, df: float, confidence: float = 0.9) -> float:
    """The one-sided upper confidence bound of an sd estimated with ``df`` degrees of freedom."""
    if not (math.isfinite(var) and df >= 1):
        return math.nan
    return math.sqrt(var * df / st.chi2.ppf(1 - confidence, df))


def seeds_for(effect: float, var_delta: float, v_example: float, alpha: float, power: float,
              cap: int = 1000) -> float:
    """Paired seeds for a two-sided t test at ``alpha`` to resolve ``effect`` with ``power``, when one seed's Δ
    has variance ``var_delta`` and the test set adds ``v_example`` that no number of seeds removes. inf when even
    infinitely many seeds would not (the test set's own noise is too large: no number suffices); ``cap + 1`` when
    more than ``cap`` are needed (a number exists, beyond the cap)."""
    if not (effect > 0 and math.isfinite(var_delta) and var_delta >= 0):
        return math.inf
    v_ex = v_example if math.isfinite(v_example) else 0.0
    if v_ex > 0 and st.norm.sf(st.norm.ppf(1 - alpha / 2) - effect / math.sqrt(v_ex)) < power:
        return math.inf  # even infinitely many seeds leave the test set's noise: the power stays below target
    def enough(n: int) -> bool:  # the power of the t test with n seeds reaches the target (rises with n)
        se = math.sqrt(var_delta / n + v_ex)
        if se == 0:
            return True
        crit = st.t.ppf(1 - alpha / 2, n - 1)
        return bool(st.nct.sf(crit, n - 1, effect / se) >= power)

    if enough(2):
        return 2
    if not enough(cap):
        return float(cap + 1)
    lo, hi = 2, cap  # not enough(lo), enough(hi): bisect on whole seeds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def seeds_range(effect: float, var_delta: float, df: float, v_example: float, alpha: float,
                power: float) -> tuple[float, float]:
    """(seeds at the estimated spread, seeds at its upper 90% bound): sizing from a declared effect, not the
    observed one, with the spread's own uncertainty."""
    lo = seeds_for(effect, var_delta, v_example, alpha, power)
    up = sd_upper(var_delta, df)
    hi = seeds_for(effect, up ** 2, v_example, alpha, power) if math.isfinite(up) else math.inf
    return lo, hi


def fmt_seeds(rng: tuple[float, float], cap: int = 1000) -> str:
    """"3", "3–5", "more than 1000" (a number exists beyond the cap), "none suffices" (the test set's own noise)."""
    lo, hi = rng

    def f(n: float) -> str:
        if not math.isfinite(n):
            return "none suffices (the validation set's own noise)"
        return f"more than {cap}" if n > cap else f"{n:g}"
    return f(lo) if lo == hi else f"{f(lo)}–{f(hi)}"


def sizing_alpha(alpha: float, tests: int) -> float:
    """The level a cell is sized at: Benjamini–Hochberg's first step, alpha / m (Bonferroni's level), the level at
    which a cell is resolved whatever the other cells of its table hold."""
    return alpha / max(tests, 1)


# --- counts with exposure ---------------------------------------------------------------------------------------
def poisson_compare(count1: float, exposure1: float, count2: float, exposure2: float) -> dict:
    """Exact conditional test of two Poisson rates (statsmodels test_poisson_2indep, 'exact-cond'): the one-sided
    p-values of rate1 > rate2 and rate1 < rate2, and the two rates per 1000 steps."""
    from statsmodels.stats.rates import test_poisson_2indep
    out = {"rate1": 1000 * count1 / exposure1 if exposure1 else math.nan,
           "rate2": 1000 * count2 / exposure2 if exposure2 else math.nan}
    if not (exposure1 > 0 and exposure2 > 0):
        return {**out, "p_larger": math.nan, "p_smaller": math.nan}
    args = (int(count1), float(exposure1), int(count2), float(exposure2))
    out["p_larger"] = float(test_poisson_2indep(*args, method="exact-cond", alternative="larger").pvalue)
    out["p_smaller"] = float(test_poisson_2indep(*args, method="exact-cond", alternative="smaller").pvalue)
    return out


def poisson_power(rate_left: float, rate_right: float, exposure: float, level: float, larger: bool = True) -> float:
    """P(poisson_compare's one-sided test rejects at ``level``) when each row's count is Poisson(rate x exposure),
    equal exposures: given the total n, the left's count is binomial(n, share) under the rates and (n, 1/2) under
    equal rates, so the test rejects beyond the binomial's critical count."""
    import numpy as np
    from scipy import stats as st
    lam_l, lam_r = rate_left * exposure, rate_right * exposure
    total = lam_l + lam_r
    if not total > 0:
        return 0.0
    n = np.arange(int(total + 12 * math.sqrt(total) + 30))
    if larger:  # reject when the left's count x has P(X >= x | n, 1/2) <= level: x >= ppf(1 - level) + 1
        crit = st.binom.ppf(1 - level, n, 0.5) + 1
        reject = np.where(crit <= n, st.binom.sf(crit - 1, n, lam_l / total), 0.0)
    else:  # reject when P(X <= x | n, 1/2) <= level
        q = st.binom.ppf(level, n, 0.5)
        crit = np.where(st.binom.cdf(q, n, 0.5) <= level, q, q - 1)
        reject = np.where(crit >= 0, st.binom.cdf(crit, n, lam_l / total), 0.0)
    return float(np.sum(st.poisson.pmf(n, total) * reject))


def poisson_seeds_for(rate_right: float, ratio: float, exposure_per_seed: float, level: float, power: float,
                      cap: int = 1000) -> float:
    """Seeds per row (each run ``exposure_per_seed`` steps) at which poisson_compare's one-sided test shows a left
    rate ``ratio`` times the right's ``rate_right`` with ``power`` at ``level``; inf past ``cap`` or at a rate of 0."""
    if not rate_right > 0:
        return math.inf
    for seeds in range(2, cap + 1):
        if poisson_power(ratio * rate_right, rate_right, seeds * exposure_per_seed, level) >= power:
            return float(seeds)
    return math.inf

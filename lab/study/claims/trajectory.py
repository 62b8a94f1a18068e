"""Claims about a run's course rather than its end (the source's multimodal case): overflow once the
scale settled, skipped steps, time to a declared training loss, where the scale settles. Each is two one-sided
p-values like every summary claim, from the summary's trajectory columns (lab/study/trajectory.py), registered at the
bottom, and joins the claims file's Holm family (lab/study/claims/).

- settled_overflows {model, mode, at_least_per_1k = 1}: the settled overflow steps over the settled steps, pooled
  over seeds, against a rate of `at_least_per_1k` per 1000 steps: exact Poisson tests both ways.
- fewer_skips {left, right}: "left skips fewer steps than right over runs of this length": an exact conditional
  Poisson test of the skipped steps summed over seeds, the runs' steps as exposure. No growth horizon: the claim
  is about the training users run, not a policy's long-run rate.
- time_to_target {left, right, ratio}: per paired seed the log of left's steps to the target over right's; a
  one-sample t over the seeds. Supported when the ratio is shown below 1 and within e^±margin_log of `ratio`
  (intersection-union: the larger p), contradicted when it is shown above ratio·e^margin_log (not as fast as
  claimed). A spread of zero decides nothing.
- scale_range {model, mode, low, high}: each seed's settled scale inside [low, high] or not; an exact sign test of
  the share inside against 1/2 (supported: most seeds are shown inside; contradicted: most outside).
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats as st

from lab.study import inference, trajectory
from lab.study.claims.base import Test, _OutOfReach, _row, _Unresolved, _value, register


def _label(body: dict) -> str:
    return f"{body['model']} {body['mode']}"


def settled_overflows(body: dict, tables: dict, reach: dict) -> Test:
    summary = tables["summary"]
    row = _row(summary, body["model"], body["mode"])
    count, exposure = _value(row, "settled_overflow_count"), _value(row, "settled_exposure")
    if not exposure > 0:
        raise _Unresolved(f"{_label(body)}: no settled steps (trajectory columns missing: re-run aggregate)")
    rate0 = float(body.get("at_least_per_1k", 1.0)) / 1000
    mu = rate0 * exposure
    p_support = float(st.poisson.sf(count - 1, mu))   # P(X >= count) at the claimed rate's edge
    p_contradict = float(st.poisson.cdf(count, mu))   # P(X <= count)
    low, high = row.get("settled_per_1k_low", math.nan), row.get("settled_per_1k_high", math.nan)
    ev = (f"{_label(body)} {count:g} overflow steps in {exposure:g} settled steps ({1000 * count / exposure:.2f} per "
          f"1000, exact interval {low:.2f}-{high:.2f}); claim ≥ {1000 * rate0:g} per 1000, exact Poisson test")
    return Test(p_support, p_contradict, ev)


def fewer_skips(body: dict, tables: dict, reach: dict) -> Test:
    summary = tables["summary"]
    rows = [_row(summary, body[s]["model"], body[s]["mode"]) for s in ("left", "right")]
    (ca, ea), (cb, eb) = ((_value(r, "skipped_count"), _value(r, "skipped_exposure")) for r in rows)
    if not (ea > 0 and eb > 0):
        raise _Unresolved("no skipped-step counts (trajectory columns missing: re-run aggregate)")
    if ca == 0 and cb == 0:
        raise _OutOfReach("neither row skipped a step: nothing to compare at this length")
    res = inference.poisson_compare(ca, ea, cb, eb)
    la, lb = (_label(body[s]) for s in ("left", "right"))
    ev = (f"{la} {ca:g} skipped steps in {ea:g} ({res['rate1']:.2f} per 1000) vs {lb} {cb:g} in {eb:g} "
          f"({res['rate2']:.2f}); exact conditional Poisson test, claim: first < second")
    return Test(res["p_smaller"], res["p_larger"], ev)


def time_to_target(body: dict, tables: dict, reach: dict) -> Test:
    summary = tables["summary"]
    rows = [_row(summary, body[s]["model"], body[s]["mode"]) for s in ("left", "right")]
    left, right = (trajectory.by_seed(r, "steps_to_target") for r in rows)
    seeds = sorted(set(left) & set(right))
    if len(seeds) < 2:
        raise _Unresolved(f"{len(seeds)} paired seed(s) with a time to target: no spread to decide on")
    logs = np.log([left[s] / right[s] for s in seeds])
    n, mean, sd = len(logs), float(logs.mean()), float(logs.std(ddof=1))
    margin = float(rows[1].get("margin_log", trajectory.DEFAULTS["margin_log"]))
    claimed = math.log(body["ratio"])
    reached = " / ".join(str(r.get("reached_target", "?")) for r in rows)
    ev = (f"{_label(body['left'])} / {_label(body['right'])} steps to target: ratio {math.exp(mean):.2f} "
          f"(geometric mean over {n} paired seeds, log sd {sd:.2f}; reached {reached}), claim {body['ratio']:g} "
          f"within ×e^±{margin:g}")
    if sd <= 1e-9:  # steps are whole numbers: a spread below this is rounding, not seeds that differ
        raise _OutOfReach(f"{ev}: every seed gives the same ratio: a spread of zero decides nothing")
    se = sd / math.sqrt(n)

    def above(x):  # p of "the mean log ratio is above x", one-sided
        return float(st.t.sf((mean - x) / se, n - 1))

    faster = 1 - above(0.0)  # shown below 1
    tost = max(above(claimed - margin), 1 - above(claimed + margin))
    return Test(max(faster, tost), above(claimed + margin), ev + "; one-sample t on the log ratio")


def scale_range(body: dict, tables: dict, reach: dict) -> Test:
    summary = tables["summary"]
    row = _row(summary, body["model"], body["mode"])
    scales = trajectory.by_seed(row, "settled_scale")
    if not scales:
        raise _Unresolved(f"{_label(body)}: no settled scales (trajectory columns missing: re-run aggregate)")
    low, high = float(body["low"]), float(body["high"])
    k, n = sum(low <= v <= high for v in scales.values()), len(scales)
    shown = ", ".join(f"2^{math.log2(v):.0f}" if v > 0 else f"{v:g}" for v in scales.values())
    ev = (f"{_label(body)} settled scale by seed {shown}: {k} of {n} inside [2^{math.log2(low):.0f}, "
          f"2^{math.log2(high):.0f}]; exact sign test against 1/2")
    # the fewest seeds that could decide: all of them on one side, at the claims' first Holm step (one-sided)
    need = math.ceil(math.log2(2 / reach["size_alpha"])) if reach.get("size_alpha") else math.nan
    return Test(float(st.binom.sf(k - 1, n, 0.5)), float(st.binom.cdf(k, n, 0.5)), ev, (need, need),
                "the sign test (every seed on one side)" if need > n else "")


NEEDS = {
    "settled_overflows": lambda b: f"settled overflow steps ≥ {b.get('at_least_per_1k', 1.0):g} per 1000, exact Poisson",
    "fewer_skips": lambda b: "skipped steps over the runs' steps, summed over seeds, exact conditional Poisson test",
    "time_to_target": lambda b: (f"steps to the declared training loss, ratio ≈ {b['ratio']:g} (TOST on the log) and "
                                 "< 1, paired over seeds"),
    "scale_range": lambda b: "each seed's settled scale in the range, exact sign test over seeds",
}


def _needs(kind: str, body: dict, summary=None, reach=None) -> str:
    return NEEDS[kind](body)


# --- the registry: kind, table, required keys, optional keys ----------------------------------------------
register("settled_overflows", "summary", {"model", "mode"}, {"at_least_per_1k"}, needs=_needs)(settled_overflows)
register("fewer_skips", "summary", {"left", "right"}, needs=_needs)(fewer_skips)
register("time_to_target", "summary", {"left", "right", "ratio"}, needs=_needs)(time_to_target)
register("scale_range", "summary", {"model", "mode", "low", "high"}, needs=_needs)(scale_range)

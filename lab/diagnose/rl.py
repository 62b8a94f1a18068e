"""The RL rule of the diagnosis: a mismatch problem (the sampler and the learner disagree) told from a scale problem.

An RL run (lab/rl/grpo_run.py) writes ``rl_steps.csv``: each step's mismatch between the log-probabilities the sampler
reported (mu) and those the learner recomputes (pi). At step 0 nothing has been trained yet, so a mismatch there is the
two paths' alone. A mismatch is a problem when the importance weights pi / mu leave PPO's band for a material share of
tokens, or their effective sample size falls: the update is then biased (grpo) or driven by a few tokens. A scale
problem is the loss scaler's: steps skipped (the other rules say how many and why). This rule says which the run has,
and advises only what its evidence supports: FP16 in both paths when a path is bf16 (Qi et al., arXiv:2510.26788:
about 8x less mismatch), truncated importance sampling when the loss has none.
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.core.runfiles import is_live, number, read_csv
from lab.diagnose.record import Diagnosis, _Builder, _pct

__all__ = ["rl_findings", "OUT_OF_BAND_MATERIAL", "ESS_LOW"]

OUT_OF_BAND_MATERIAL = 0.01   # >= 1% of tokens with pi / mu outside [1 - eps, 1 + eps]: the mismatch moves the update
OUT_OF_BAND_SEVERE = 0.05     # >= 5%: a problem
ESS_LOW = 0.9                 # the importance weights' effective sample size below 90% of the tokens
SKIP_MATERIAL = 0.05          # >= 5% of steps skipped: the loss scale is a problem of its own
COLUMNS = ("step", "reward", "abs_mean", "out_of_band", "ess", "clipped")


def _read(path: Path) -> list[dict]:
    _, raw = read_csv(path, COLUMNS, live=is_live(path))
    return [{c: number(path, r, c, int if c == "step" else float) for c in COLUMNS} for r in raw]


def rl_findings(b: _Builder, d: Diagnosis, run_dir: Path, metrics: dict) -> None:
    path = Path(run_dir) / "rl_steps.csv"
    if not path.is_file():
        return
    rows = _read(path)
    if not rows:
        return
    first = rows[0]
    oob = max(r["out_of_band"] for r in rows)
    ess = min(r["ess"] for r in rows)
    mean_abs = sum(r["abs_mean"] for r in rows) / len(rows)
    sampler, learner = metrics.get("sampler"), metrics.get("learner")
    d.rl = {"sampler": sampler, "learner": learner, "loss": metrics.get("loss_kind"), "mismatch_abs_mean": mean_abs,
            "out_of_band_step0": first["out_of_band"], "out_of_band_max": oob, "ess_min": ess,
            "reward_first": first["reward"], "reward_last": rows[-1]["reward"]}
    mismatch = oob >= OUT_OF_BAND_MATERIAL or ess < ESS_LOW
    scale = d.skip_rate >= SKIP_MATERIAL
    said = (f"mean |log pi - log mu| {mean_abs:.2g} per token; pi / mu outside PPO's band for {_pct(first['out_of_band'])} "
            f"of tokens at step 0 (before any update: the two paths alone), at most {_pct(oob)}; the weights' "
            f"effective sample size at least {_pct(ess)}")
    paths = f"sampler {sampler}, learner {learner}"
    if mismatch:
        severe = first["out_of_band"] >= OUT_OF_BAND_SEVERE or ess < 0.5
        b.find("rl_mismatch", "problem" if severe else "warning", f"the sampler and the learner disagree ({paths}): "
               f"{said}: the update is biased toward what the sampler drew", **d.rl)
        if "bf16" in (sampler, learner):
            b.recommend("fp16_both_paths", "Sample and learn in FP16 in both paths, with a loss scaler (bf16's 8 bits "
                        "of mantissa disagree about 8x more than FP16's 11)", f"{paths}: {said}", "rl_mismatch",
                        change={"precision": "fp16"})
        if metrics.get("loss_kind") == "grpo":
            b.recommend("truncated_is", "Weight each token by min(pi_old / mu, 2) (truncated importance sampling, "
                        "loss grpo-tis, or a mode's correction: {name: token-tis, cap: 2.0}) instead of the sampler "
                        "as the behaviour policy",
                        f"{_pct(oob)} of tokens outside the band get no gradient under PPO's clip", "rl_mismatch")
    else:
        b.find("rl_mismatch_small", "info", f"the sampler and the learner agree ({paths}): {said}: not a cause here",
               **d.rl)
    which = ("both the mismatch and the loss scale" if mismatch and scale else "the mismatch, not the loss scale"
             if mismatch else "the loss scale, not the mismatch" if scale else "neither the mismatch nor the loss "
             "scale")
    d.notes.append(f"RL run: {which} ({_pct(d.skip_rate)} of steps skipped; {_pct(oob)} of tokens out of PPO's band "
                   f"at most; reward {first['reward']:.3f} at step 0, {rows[-1]['reward']:.3f} at the last)")
    if not math.isfinite(mean_abs):
        b.find("rl_mismatch_nonfinite", "problem", "the mismatch is not finite: a log-probability was inf or NaN in "
               "one of the paths", **d.rl)

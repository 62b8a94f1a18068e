"""A loss-scale controller learned by reinforcement learning in the replay (the source study's "dynamic controller
based on reinforcement learning").

The environment is the replay's model of a step (lab/diagnose/replay.py ``ReplayEnv``) over recorded runs: at each
step the controller's scale S meets the run's recorded gradients; an overflow skips the step; the census histograms
say which share of the gradient values S flushes. The controller sees only what a scaler sees online (the
observations amax-history keeps: the unscaled gradients' amax, or the least amax that explains an overflow) and
acts once a step: halve, hold or double the scale.

Reward per step: ``-(skipped + flushed)``: a skipped step loses the whole step's gradient, a flushed share f loses
that share of its values; the two are counted in the same unit (a step's gradient values), declared here, not tuned.

The policy is linear-softmax over ``FEATURES`` (the learned predictor's scale-free history features, plus where the
last step's amax sits at the current scale and how long since an overflow), trained by REINFORCE with a per-step
baseline (the batch's mean return at that step) and Adam; frozen, it takes the most probable action
(``rl-controller`` policy, lab/scaling/policies/rl_controller.py). Everything is seeded: the same runs and seed give the
same weights.
"""
from __future__ import annotations

import collections
import math

from lab.scaling.learning.features import FEATURES as HISTORY_FEATURES, WINDOW, features

#: the controller's inputs, in its weights' order: of the history's features, those that say how fast and how
#: erratically the amax moves (the level itself is in top_binades)
FROM_HISTORY = ("intercept", "last_change", "sd16", "largest_jump16")
FEATURES = FROM_HISTORY + ("top_binades", "overflowed", "since_overflow")
_PICK = [HISTORY_FEATURES.index(f) for f in FROM_HISTORY]
#: its actions: the change of log2 scale
ACTIONS = (-1, 0, 1)
MIN_LOG2, MAX_LOG2 = -24, 24
SINCE_CAP = 64


class ControllerState:
    """What the controller keeps between steps: its observation window and the steps since an overflow."""

    def __init__(self):
        self.window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.overflowed, self.since = False, SINCE_CAP

    def observe(self, scale: float, found_inf: bool, grad_amax: float) -> None:
        from lab.scaling.policies.amax import step_observation
        self.window.appendleft(step_observation(scale, found_inf, grad_amax, 0))
        self.overflowed = bool(found_inf)
        self.since = 0 if found_inf else min(self.since + 1, SINCE_CAP)

    def features(self, scale: float) -> torch.Tensor:
        """The FEATURES vector after the latest observation, at the scale the next step would start from."""
        import torch
        from lab.core.fp16 import MAX  # torch and FP16's bounds at the first step, not with the policy's check
        amax = torch.tensor(list(self.window), dtype=torch.float64)
        f, last = features(amax, torch.ones_like(amax, dtype=torch.bool))
        top = (math.log2(MAX) - math.log2(scale) - float(last)) / 8.0
        return torch.cat([f[_PICK], torch.tensor([top, float(self.overflowed), self.since / SINCE_CAP],
                                          dtype=torch.float64)])


def next_scale(scale: float, action: int) -> float:
    """The scale after an action, a power of two kept within [2^-24, 2^24]."""
    log2 = min(MAX_LOG2, max(MIN_LOG2, round(math.log2(scale)) + ACTIONS[action]))
    return math.ldexp(1.0, log2)


def episode(env, decide, init_scale: float) -> tuple[list[float], list[bool], list[float]]:
    """Any rule over a ReplayEnv, as the replay runs a policy: at step i the scale meets the recorded gradients
    (``env.outcome``), then ``decide(i, scale, found, grad_amax)`` returns the next scale, given what the engine
    would observe (``env.observations``). Returns (the scale, the overflow and the flushed share of every step)."""
    scale, scales, overflows, flushed = init_scale, [], [], []
    for i in range(len(env)):
        found, _ = env.outcome(i, scale)
        flushed.append(env.flushed(i, scale) or 0.0)
        scales.append(scale)
        overflows.append(found)
        scale = decide(i, scale, found, env.observations(i, found)[1])
    return scales, overflows, flushed


def rollout(env, weights: torch.Tensor, init_scale: float, generator: torch.Generator | None):
    """The controller over one ReplayEnv (``episode``): (features (T, F), actions (T,), rewards (T,), skipped,
    flushed summed). With a generator the actions are sampled from the softmax policy (training); without, the
    most probable (frozen)."""
    import torch
    state = ControllerState()
    feats, actions = [], []

    def decide(i, scale, found, amax):
        state.observe(scale, found, amax)
        phi = state.features(scale)
        logits = weights @ phi
        if generator is None:
            a = int(torch.argmax(logits))
        else:
            a = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=generator))
        feats.append(phi)
        actions.append(a)
        return next_scale(scale, a)

    scales, overflows, flushed = episode(env, decide, init_scale)
    rewards = -(torch.tensor(overflows, dtype=torch.float64) + torch.tensor(flushed, dtype=torch.float64))
    return torch.stack(feats), torch.tensor(actions), rewards, sum(overflows), sum(flushed)


def train(envs: list, seed: int = 0, iterations: int = 150, lr: float = 0.05, gamma: float = 0.9,
          entropy: float = 0.01, init_scale: float = 1024.0, progress=None) -> dict:
    """REINFORCE over the environments (each iteration one sampled episode per environment). Returns the weights
    (len(ACTIONS) x len(FEATURES), as lists) and the training curve (mean return per iteration)."""
    import torch
    if not envs:
        raise ValueError("no environments to learn in: the runs given hold no steps with grad_amax")
    gen = torch.Generator().manual_seed(seed)
    weights = torch.zeros(len(ACTIONS), len(FEATURES), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([weights], lr=lr)
    curve = []
    for it in range(iterations):
        episodes = [rollout(env, weights.detach(), init_scale, gen) for env in envs]
        # the discounted return from step t on; action t sets step t+1's scale, so step t's own reward in it does not
        # depend on the action: variance, no bias (the baseline removes most of it)
        returns = []
        for _, _, r, _, _ in episodes:
            g, out = 0.0, torch.empty_like(r)
            for t in range(len(r) - 1, -1, -1):
                g = float(r[t]) + gamma * g
                out[t] = g
            returns.append(out)
        horizon = max(len(g) for g in returns)
        padded = torch.full((len(returns), horizon), float("nan"), dtype=torch.float64)
        for k, g in enumerate(returns):
            padded[k, :len(g)] = g
        baseline = torch.nanmean(padded, 0)
        # advantages in units of their spread: the step size does not depend on how costly the batch was
        scale_adv = float(torch.nanmean((padded - baseline) ** 2).sqrt()) + 1e-8
        loss = torch.zeros((), dtype=torch.float64)
        steps = 0
        for (phi, a, _, _, _), g in zip(episodes, returns):
            logp = torch.log_softmax(phi @ weights.t(), 1)
            adv = (g - baseline[:len(g)]) / scale_adv
            loss = loss - (logp[torch.arange(len(a)), a] * adv).sum() - entropy * (-(logp.exp() * logp).sum())
            steps += len(a)
        opt.zero_grad()
        (loss / steps).backward()
        opt.step()
        curve.append(float(sum(float(r.sum()) for _, _, r, _, _ in episodes) / len(episodes)))
        if progress is not None:
            progress(it, curve[-1])
    return {"coef": weights.detach().flatten().tolist(), "shape": [len(ACTIONS), len(FEATURES)],
            "curve": curve}


def describe(weights: torch.Tensor) -> dict:
    """What the frozen controller does: each feature's pull toward doubling against halving (the difference of
    its weights for +1 and -1), and its action after an overflow against after a clean step, all else at zero."""
    import torch
    weights = weights.to(torch.float64)
    pull = (weights[ACTIONS.index(1)] - weights[ACTIONS.index(-1)]).tolist()
    base = torch.zeros(len(FEATURES), dtype=torch.float64)
    base[FEATURES.index("intercept")] = 1.0
    clean, after = base.clone(), base.clone()
    clean[FEATURES.index("since_overflow")] = 1.0
    after[FEATURES.index("overflowed")] = 1.0
    return {"pull_to_double": dict(zip(FEATURES, [round(p, 4) for p in pull])),
            "action_after_overflow": ACTIONS[int(torch.argmax(weights @ after))],
            "action_after_long_clean_run": ACTIONS[int(torch.argmax(weights @ clean))]}

"""A GRPO run into a run directory, and the base policy it starts from (``python -m lab rl-base``, ``lab rl-train``:
lab/commands/rl.py).

The base (``rl-base``): a GPT of the study's LM size (2 layers, width 64) pre-trained in FP32 on the arithmetic task's
lines (lab/rl/task.py) for ``--steps`` steps, saved with its settings; every mode of the RL study starts from the same
base (the reference policy). A run (``rl-train``): GRPO steps (lab/rl/grpo.py) under one mode of a config file
(``configs/rl.yaml``: ``modes: {name: {sampler, learner, scaler: {policy, ...} or null, loss, correction, fuse}}``),
recorded with ``lab.record`` (steps.csv: scale, overflow, skips; census.csv; metrics.json; lab diagnose reads it)
with a replay of each step's batch, plus ``rl_steps.csv`` (each step's reward, loss, clipped share and mismatch over
the answer's tokens: lab/rl/mismatch.py's numbers, verl's ``kl``, ``k3_kl``, ``chi2_token``, ``chi2_seq`` and
``rollout_is_eff_sample_size`` among them) and, in metrics.json, the share of held-out problems solved before and
after (sampled in FP32: the policy's quality, not its sampler's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab.core import files, runfiles
from lab.models.gpt import GPTConfig
from lab.rl import paths, task
from lab.rl.grpo import GRPOConfig, grpo_step, learner_loss, rollout
from lab.rl.mismatch import CAPS, PROB_BINS
from lab.rl.grpo_study import RLMode, sampler_name

__all__ = ["RLRun", "pretrain_base", "train", "solved", "base_model", "save_base", "mode_scaler"]

#: the per-token |log pi - log mu| histogram (rl_mismatch_hist.csv): half-decade bins from 1e-10 to 10; exact zeros apart
HIST_EDGES = [10.0 ** (k / 2) for k in range(-20, 3)]
STEP_FIELDS = ["step", "reward", "loss", "clipped", "abs_mean", "abs_p99", "abs_max", "k1", "k3", "out_of_band",
               "out_of_half_double", "ess", "seq_abs_mean",
               # verl's names and the lab's bands (lab/rl/mismatch.py), appended: the columns above keep their place
               "kl", "k3_kl", "chi2_token", "chi2_seq", "rollout_is_eff_sample_size", "p_abs_diff_max",
               *(f"out_of_c{c:g}" for c in CAPS)]
def base_model() -> torch.nn.Module:
    return GPTConfig(vocab_size=task.VOCAB, context=task.PROMPT_LEN + task.ANSWER_LEN, n_layer=2, n_head=4,
                     d_model=64).build()


def pretrain_base(steps: int = 400, seed: int = 0, batch: int = 64, lr: float = 3e-3) -> torch.nn.Module:
    """The base policy: FP32 next-character training on the answers of generated lines."""
    torch.manual_seed(seed)
    model = base_model()
    opt, g = torch.optim.AdamW(model.parameters(), lr=lr), torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = task.lines(task.problems(batch, g))
        target = x[:, 1:].clone()
        target[:, :task.PROMPT_LEN - 1] = -100  # the answer only
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, task.VOCAB), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def solved(model, n: int = 512, seed: int = 99) -> float:
    """The share of ``n`` held-out problems the policy solves, sampled in FP32."""
    pairs = task.problems(n, torch.Generator().manual_seed(seed))
    tokens, _ = paths.sample(model, task.prompts(pairs), task.ANSWER_LEN, paths.engine("fp32"),
                             torch.Generator().manual_seed(seed + 1))
    return float(task.reward(pairs, tokens[:, task.PROMPT_LEN:]).mean())


@dataclass
class RLRun:
    mode: RLMode
    seed: int = 0
    steps: int = 60
    prompts: int = 16
    group: int = 8
    lr: float = 3e-4
    divisor: float = 1.0        # the loss / divisor per backward, multiplied back after unscale_ (grpo_step)
    census_every: int = 10
    log_every: int = 10
    extra: dict = field(default_factory=dict)

    def grpo(self) -> GRPOConfig:
        m = self.mode
        return GRPOConfig(prompts=self.prompts, group=self.group, loss=m.loss, correction=m.correction,
                          sampler=m.sampler, learner=m.learner, fuse=m.fuse)


def mode_scaler(spec: dict | None):
    """The loss scaler a mode's ``scaler: {policy, ...}`` line names, on the CPU; None for ``scaler: null``."""
    if spec is None:
        return None
    import lab.scaling
    return lab.scaling.create(spec["policy"], device="cpu", **{k: v for k, v in spec.items() if k != "policy"})


def train(run: RLRun, base: Path, out: Path) -> dict:
    """GRPO from the base saved at ``base`` into run directory ``out``; returns metrics.json's content."""
    import lab
    saved = runfiles.read_tensors(base, map_location="cpu")  # RunFileError naming a cut or damaged file
    model = base_model()
    model.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    mode, cfg = run.mode, run.grpo()
    scaler = mode_scaler(mode.scaler)
    now: dict = {}

    def replay():  # this step's batch through the learner again, scaled as the step was (lab.record's replay)
        loss, _ = learner_loss(model, cfg, now["batch"])
        (scaler.scale(loss / run.divisor) if scaler is not None else loss / run.divisor).backward()

    start = solved(model)
    rows, g, gs = [], torch.Generator().manual_seed(1000 + run.seed), torch.Generator().manual_seed(2000 + run.seed)
    hist = torch.zeros(len(HIST_EDGES) + 2, dtype=torch.long)  # exact zeros, (.., 1e-10], ..., (3.2, 10], above 10
    by_prob = torch.zeros(2, len(PROB_BINS), dtype=torch.float64)  # |d| summed, tokens counted, by mu's bin
    hist_edges, prob_edges = torch.tensor(HIST_EDGES, dtype=torch.float64), torch.tensor(PROB_BINS, dtype=torch.float64)
    torch.manual_seed(run.seed)
    rec = lab.record(model, scaler, out=out, optimizer=opt, precision=mode.learner, census_every=run.census_every,
                     log_every=run.log_every, replay=replay if scaler is not None else None, name="gpt-arith",
                     seed=run.seed)
    try:
        for step in range(run.steps):
            now["batch"] = rollout(model, cfg, task.problems(cfg.prompts, g), gs)
            result = grpo_step(model, opt, scaler, cfg, None, gs, divisor=run.divisor, batch=now["batch"])
            rec.step(result["loss"])
            opt.zero_grad(set_to_none=True)
            m = result["mismatch"]
            d = result["abs_d"].double()
            hist[0] += int((d == 0).sum())
            hist[1:] += torch.bincount(torch.bucketize(d[d > 0], hist_edges),
                                       minlength=len(HIST_EDGES) + 1)
            bins = torch.bucketize(result["mu"].double(), prob_edges)
            by_prob[0] += torch.bincount(bins, weights=d, minlength=len(PROB_BINS))[:len(PROB_BINS)]
            by_prob[1] += torch.bincount(bins, minlength=len(PROB_BINS))[:len(PROB_BINS)].double()
            rows.append({"step": step, "reward": result["reward"], "loss": float(result["loss"].detach()),
                         "clipped": result["clipped"], **{k: m[k] for k in STEP_FIELDS[4:]}})
            if (step + 1) % run.log_every == 0:
                files.atomic_write_csv(out / "rl_steps.csv", rows, STEP_FIELDS)
        files.atomic_write_csv(out / "rl_steps.csv", rows, STEP_FIELDS)
        end = solved(model)
    except BaseException as e:  # the recording says failed, with the error; what was trained so far is kept
        files.atomic_write_csv(out / "rl_steps.csv", rows, STEP_FIELDS)
        rec.close(error=e)
        raise
    files.atomic_write_csv(out / "rl_mismatch_hist.csv", _hist_rows(hist), ["upper", "tokens"])
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("abs_mean", "k3", "out_of_band", "clipped")}
    rec.close(solved_start=start, solved_end=end, train_reward_last10=sum(r["reward"] for r in rows[-10:])
              / min(10, len(rows)), sampler=sampler_name(mode.sampler), learner=mode.learner,
              loss_kind=mode.loss_kind,
              divisor=run.divisor, steps=run.steps, **{f"mismatch_{k}": v for k, v in mean.items()},
              **_by_prob(by_prob))
    return runfiles.read_json(out / "metrics.json")


def save_base(model: torch.nn.Module, out: Path, steps: int, seed: int) -> float:
    """Write the base policy to ``out`` atomically (a killed pre-training leaves no half file); its share solved."""
    rate = solved(model)
    state = {"model": model.state_dict(), "steps": steps, "seed": seed, "solved": rate}
    files.atomic_write(out, lambda f: torch.save(state, f), mode="wb")
    return rate


def _by_prob(by_prob: torch.Tensor) -> dict:
    """metrics.json's mismatch by the sampler's probability over the whole run: each bin's mean |d| and tokens, and
    the means below and above mu = 0.5 (None where no token fell)."""
    def mean(total, n):
        return float(total / n) if n > 0 else None
    out, lo = {}, 0.0
    for i, hi in enumerate(PROB_BINS):
        out[f"mismatch_mu_{lo:g}_{hi:g}"] = mean(by_prob[0, i], by_prob[1, i])
        out[f"tokens_mu_{lo:g}_{hi:g}"] = int(by_prob[1, i])
        lo = hi
    low = [i for i, hi in enumerate(PROB_BINS) if hi <= 0.5]
    high = [i for i, hi in enumerate(PROB_BINS) if hi > 0.5]
    out["mismatch_low_prob"] = mean(by_prob[0, low].sum(), by_prob[1, low].sum())
    out["mismatch_high_prob"] = mean(by_prob[0, high].sum(), by_prob[1, high].sum())
    return out


def _hist_rows(hist: torch.Tensor) -> list[dict]:
    """rl_mismatch_hist.csv: each bin's upper edge (0: exact zeros; inf: 10 and above) and its token count."""
    uppers = [0.0] + HIST_EDGES + [float("inf")]
    return [{"upper": u, "tokens": int(n)} for u, n in zip(uppers, hist.tolist())]

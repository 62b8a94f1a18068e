"""A DPO run of the RL study's DPO family into a run directory, and the base it starts from (``python -m lab
rl-dpo-base``, ``lab rl-dpo-train``: lab/commands/rl_dpo.py; the family: configs/rl.yaml's ``dpo:`` block,
lab/rl/dpo_study.py).

The corpus is the LM family's, pydoc (lab/data/text.py), in its two halves of whole documents: the base (a GPT of the
study's LM size, 2 layers x width 64, pydoc's 1024-word vocabulary, context 64) pre-trains in FP32 on the pretrain
half; the DPO pairs (lab/rl/dpo.py ``pairs``: a 16-token prompt, the real 48-token continuation preferred to its
corruption) come from the fine-tuning half, the training pairs from its training documents and the 256 held-out pairs
(the same for every run) from its validation documents (30% of them, so that 256 windows of 64 tokens fit). The
bigram table the corruption draws from is the fine-tuning half's training documents'.

A run (``rl-dpo-train``): DPO steps from the base with the frozen base as the reference, under one mode (the learner's
format, the sequence sum's format, the loss scaler), recorded with ``lab.record`` (steps.csv: scale, overflow, skips;
census.csv; metrics.json; ``lab diagnose`` reads it) with a replay of each step's batch, plus ``dpo_steps.csv`` (each
step's loss, mean margin, share of pairs with a positive margin, and whether every margin was finite, as the run's
own sum computed them) and, in metrics.json, the held-out preference accuracy before and after: the share of held-out
pairs where the policy gives the real continuation the higher sequence log-probability (an FP32 forward summed in
FP32: the policy, not its sum), the mean implicit reward margin beta * ((log pi - log ref)(c) - (...)(r)) at the end
and the share where it is positive (TRL's rewards/accuracies; 0 at the start, where the policy is its reference).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from lab.core import files, runfiles
from lab.models.gpt import GPTConfig
from lab.rl.dpo import DPOConfig, dpo_forward, dpo_step, pairs, sequence_logprob, token_table
from lab.rl.dpo_study import DPOMode

__all__ = ["DPORun", "dpo_model", "pretrain_dpo_base", "save_dpo_base", "train_dpo", "held_out_pairs", "preference",
           "STEP_FIELDS"]

VOCAB, PROMPT, CONTINUATION = 1024, 16, 48
VAL_FRACTION, SPLIT_SEED = 0.3, 0
HELD_OUT, HELD_OUT_SEED = 256, 99
STEP_FIELDS = ["step", "loss", "margin", "accuracy", "finite"]


def corpus(part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """pydoc's ``part`` half (pretrain | finetune) as token streams (train, val), in the pretrain half's vocabulary."""
    from lab.data.text import load_corpus  # when a run reads it (lab.rl's import-time graph: tests/test_public_api.py)
    train, val, _, _ = load_corpus("pydoc", None, VOCAB, VAL_FRACTION, SPLIT_SEED, part)
    return train, val


def dpo_model() -> torch.nn.Module:
    return GPTConfig(vocab_size=VOCAB, context=PROMPT + CONTINUATION, n_layer=2, n_head=4, d_model=64).build()


def pretrain_dpo_base(steps: int = 300, seed: int = 0, batch: int = 16, lr: float = 3e-3) -> torch.nn.Module:
    """The base: FP32 next-token training on random 65-token windows of pydoc's pretrain half."""
    torch.manual_seed(seed)
    model = dpo_model()
    stream, _ = corpus("pretrain")
    opt, g = torch.optim.AdamW(model.parameters(), lr=lr), torch.Generator().manual_seed(seed)
    n = PROMPT + CONTINUATION + 1
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - n, (batch,), generator=g)
        x = torch.stack([stream[s: s + n] for s in starts.tolist()])
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def val_loss(model) -> float:
    """Next-token loss (nats) on the pretrain half's validation documents, in non-overlapping 65-token windows."""
    _, val = corpus("pretrain")
    n = PROMPT + CONTINUATION + 1
    x = val[: len(val) // n * n].reshape(-1, n)
    return float(torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1)))


def save_dpo_base(model: torch.nn.Module, out: Path, steps: int, seed: int) -> float:
    """Write the base to ``out`` atomically (a killed pre-training leaves no half file); its validation loss."""
    loss = val_loss(model)
    state = {"model": model.state_dict(), "steps": steps, "seed": seed, "val_loss": loss}
    files.atomic_write(out, lambda f: torch.save(state, f), mode="wb")
    return loss


@lru_cache(maxsize=4)
def _table(corruption: str) -> torch.Tensor | None:
    return token_table(corpus("finetune")[0], VOCAB, corruption)


def held_out_pairs(corruption: str = "bigram", k: int = 1) -> dict:
    """The 256 held-out pairs (the fine-tuning half's validation documents; one fixed draw for every run)."""
    _, val = corpus("finetune")
    return pairs(val, HELD_OUT, PROMPT, CONTINUATION, torch.Generator().manual_seed(HELD_OUT_SEED), corruption, k,
                 _table(corruption))


@torch.no_grad()
def preference(model, batch: dict, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence log-probabilities of the chosen and the rejected continuations: an FP32 forward, summed in FP32."""
    def logp(tokens):
        return torch.cat([sequence_logprob(model, tokens[i: i + chunk], batch["prompt"], "fp32", "fp32")
                          for i in range(0, len(tokens), chunk)])
    return logp(batch["chosen"]), logp(batch["rejected"])


@dataclass
class DPORun:
    mode: DPOMode
    seed: int = 0
    steps: int = 40
    pairs: int = 16
    lr: float = 1e-3
    beta: float = 0.1
    census_every: int = 10
    corruption: str = "bigram"
    k: int = 1
    log_every: int = 10

    def dpo(self) -> DPOConfig:
        return DPOConfig(beta=self.beta, learner=self.mode.learner, sum_dtype=self.mode.sum)


def train_dpo(run: DPORun, base: Path, out: Path) -> dict:
    """DPO from the base saved at ``base`` into run directory ``out``; returns metrics.json's content."""
    import lab
    from lab.rl.grpo_run import mode_scaler
    saved = runfiles.read_tensors(base, map_location="cpu")  # RunFileError naming a cut or damaged file
    model = dpo_model()
    model.load_state_dict(saved["model"])
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    mode, cfg = run.mode, run.dpo()
    scaler = mode_scaler(mode.scaler)
    now: dict = {}

    def replay():  # this step's batch through the policy again, scaled as the step was (lab.record's replay)
        loss, _ = dpo_forward(model, reference, cfg, now["batch"])
        (scaler.scale(loss) if scaler is not None else loss).backward()

    held = held_out_pairs(run.corruption, run.k)
    ref_c, ref_r = preference(reference, held)
    start = float((ref_c > ref_r).float().mean())
    stream, table = corpus("finetune")[0], _table(run.corruption)
    rows, nonfinite, g = [], 0, torch.Generator().manual_seed(1000 + run.seed)
    torch.manual_seed(run.seed)
    rec = lab.record(model, scaler, out=out, optimizer=opt, precision=mode.learner, census_every=run.census_every,
                     log_every=run.log_every, replay=replay if scaler is not None else None, name="gpt-pydoc-dpo",
                     seed=run.seed)
    try:
        for step in range(run.steps):
            now["batch"] = pairs(stream, run.pairs, PROMPT, CONTINUATION, g, run.corruption, run.k, table)
            result = dpo_step(model, reference, opt, scaler, cfg, now["batch"])
            rec.step(result["loss"])
            opt.zero_grad(set_to_none=True)
            nonfinite += not result["finite"]
            rows.append({"step": step, "loss": float(result["loss"].detach()), "margin": result["margin"],
                         "accuracy": result["accuracy"], "finite": int(result["finite"])})
            if (step + 1) % run.log_every == 0:
                files.atomic_write_csv(out / "dpo_steps.csv", rows, STEP_FIELDS)
        files.atomic_write_csv(out / "dpo_steps.csv", rows, STEP_FIELDS)
        pi_c, pi_r = preference(model, held)
    except BaseException as e:  # the recording says failed, with the error; what was trained so far is kept
        files.atomic_write_csv(out / "dpo_steps.csv", rows, STEP_FIELDS)
        rec.close(error=e)
        raise
    margin = run.beta * ((pi_c - ref_c) - (pi_r - ref_r))
    last = rows[-10:]
    rec.close(accuracy_start=start, accuracy_end=float((pi_c > pi_r).float().mean()),
              margin_end=float(margin.mean()), reward_accuracy_end=float((margin > 0).float().mean()),
              nonfinite_steps=nonfinite, sum_dtype=mode.sum, learner=mode.learner, beta=run.beta, pairs=run.pairs,
              corruption=run.corruption, k=run.k, held_out_pairs=HELD_OUT,
              train_accuracy_last10=sum(r["accuracy"] for r in last) / len(last) if last else None)
    return runfiles.read_json(out / "metrics.json")

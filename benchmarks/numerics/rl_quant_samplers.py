"""Each quantized sampler (lab/rl/samplers) teacher-forced on the same tokens against the FP32 learner: one line
per declaration, k1 and k3 of KL(pi || mu) and mean |log pi - log mu| over the generated tokens.

The tokens are drawn once by the FP32 sampler, so they are pi's draws: k1 = mean(log pi - log mu) and k3 =
mean(r - 1 - log r), r = mu / pi, estimate KL(pi || mu) without bias (lab/rl/mismatch.py's estimators with the roles
of the two policies swapped: its k1 and k3 assume mu's draws). Each sampler's log-probabilities mu are its path's
full forward on them (lab/rl/paths.logprobs: its weights quantized once, its KV cache calibrated on the prompts'
prefill first), the learner's pi the FP32 training forward's. Two models: the RL study's base (pre-trained here
as `lab rl-base` does, 400 steps, seed 0; answers to 256 held-out problems, the tokens up to the first ";") and a
random 4-layer GPT (width 128, vocabulary 256: 32 prompts of 16 tokens, 32 generated).

    python benchmarks/numerics/rl_quant_samplers.py [base|random]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.models.gpt import GPTConfig  # noqa: E402
from lab.rl import paths, samplers, task  # noqa: E402
from lab.rl.grpo import answer_mask  # noqa: E402
from lab.rl.grpo_run import pretrain_base  # noqa: E402
from lab.rl.mismatch import mismatch  # noqa: E402

#: one factor over a declaration's defaults, on fp8-tensor
VARIANTS = [("kv", "current"), ("source", "copy"), ("head_fp32", True)]


def rows() -> list[tuple[str, object]]:
    out = [("bf16", "bf16"), ("fp16", "fp16")]
    out += [(f"bf16+{n}", {"path": "bf16", "quant": n}) for n in samplers.available() if n != "none"]
    out += [(f"bf16+fp8-tensor,{k}={v}", {"path": "bf16", "quant": "fp8-tensor", k: v}) for k, v in VARIANTS]
    out += [("bf16+none,kv=current", {"path": "bf16", "quant": "none", "kv": "current"})]
    return out


def measure(model, prompts: torch.Tensor, new: int, keep_of) -> None:
    tokens, _ = paths.sample(model, prompts, new, paths.engine("fp32"), torch.Generator().manual_seed(7))
    n = prompts.shape[1]
    pi = paths.logprobs(model, tokens, n, paths.learner("fp32"))
    keep = keep_of(tokens[:, n:]).bool()
    print("| sampler | tokens | k1 KL(pi, mu) | k3 KL(pi, mu) | mean abs(d) |\n|---|---|---|---|---|")
    for label, spec in rows():
        rd = samplers.sampler_path(spec)
        paths.calibrate_kv(model, prompts, rd)
        m = mismatch(pi[keep][None], paths.logprobs(model, tokens, n, rd)[keep][None])  # pi drew the tokens
        print(f"| {label} | {m['tokens']} | {m['k1']:.2e} | {m['k3']:.2e} | {m['abs_mean']:.2e} |")


def main(which: str = "base") -> int:
    if which == "base":
        model = pretrain_base(400, seed=0).eval()
        pairs = task.problems(256, torch.Generator().manual_seed(99))
        measure(model, task.prompts(pairs), task.ANSWER_LEN, answer_mask)
    else:
        torch.manual_seed(0)
        model = GPTConfig(vocab_size=256, context=64, n_layer=4, n_head=4, d_model=128).build().eval()
        prompts = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(1))
        measure(model, prompts, 32, torch.ones_like)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""The RL sampler/learner mismatch on real 16-bit kernels, beside the CPU study's emulation (step 5).

The CPU study (benchmarks/numerics/rl_mismatch.py, docs/rl.md) emulates both paths (lab/rl/paths.py): rounding to the format at
named points, FP32 elsewhere. Here, on one random lab GPT (seed 0, 32 prompts of 16 tokens, 32 new tokens), per format:

* native: the sampler is a real inference path, a copy of the model with its parameters in the format, every
  activation, the residual stream and the KV cache in the format (``native_forward``: lab/models/gpt.py's computation,
  SDPA attention), sampling from the FP32 softmax of its logits; the learner is the training forward, the FP32 model
  under autocast (on a CPU the lab's autocast, with its tensor-core contract);
* contract: the emulated engine against the emulated learner on the CPU, the numbers the CPU study rests on;
* native vs emulated: on the native sampler's tokens, |mu_native - mu_emulated engine| and |pi_autocast -
  pi_emulated learner|: how close each emulation is to the real kernels.

    python benchmarks/gpu/rl_mismatch_cuda.py --device cuda --out rl_mismatch.json    # --device cpu: the rehearsal

Tokens are drawn on the CPU, from the probabilities, with one torch.Generator seeded as paths.sample's: every sampler
(native on either device, emulated) reads the same random stream, so their draws differ only where their
probabilities do; a CUDA generator's stream would differ from the CPU's. It costs one small copy per token.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402
from lab.models.gpt import GPTConfig  # noqa: E402
from lab.numerics.precision import autocast_for  # noqa: E402
from lab.rl import paths  # noqa: E402
from lab.rl.mismatch import PROB_BINS, mismatch  # noqa: E402
from lab.run.process import set_fp32_reductions, set_true_fp32  # noqa: E402

PROMPT, NEW, BATCH, SAMPLE_SEED = 16, 32, 32, 2


def setup() -> tuple[torch.nn.Module, torch.Tensor]:
    """benchmarks/numerics/rl_mismatch.py's model and prompts (both on the CPU, FP32)."""
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=256, context=64, n_layer=4, n_head=4, d_model=128).build().eval()
    return model, torch.randint(0, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def native_model(model, fmt: str, device) -> torch.nn.Module:
    """The sampler's copy: every parameter (embeddings, LayerNorms) held in the format; the head stays tied."""
    return copy.deepcopy(model).to(device=device, dtype=paths.FORMATS[fmt]).eval()


def attend(q, k, v):
    """Causal SDPA of ``q`` (the last T positions) over ``k``, ``v`` (all S so far). SDPA's ``is_causal`` aligns its
    mask top-left, right only when T == S; a single decoded token sees every position, so needs no mask."""
    T, S = q.shape[-2], k.shape[-2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def native_forward(m, idx: torch.Tensor, cache: list | None = None) -> torch.Tensor:
    """Logits, in ``m``'s dtype, of ``idx`` continuing ``cache`` (per-block (k, v), grown in place; None: one full
    pass). GPT.forward's computation with a KV cache; each op runs in the tensors' dtype (no autocast): LayerNorm, GELU
    and the residual adds on 16-bit tensors, as an inference engine holds them."""
    start = cache[0][0].shape[-2] if cache else 0
    B, T = idx.shape
    x = m.tok(idx) + m.pos(torch.arange(start, start + T, device=idx.device))
    for i, blk in enumerate(m.blocks):
        C, H = x.shape[-1], blk.attn.n_head
        q, k, v = blk.attn.qkv(blk.ln1(x)).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if i < len(cache):
                k, v = torch.cat([cache[i][0], k], dim=-2), torch.cat([cache[i][1], v], dim=-2)
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        x = x + blk.attn.proj(attend(q, k, v).transpose(1, 2).reshape(B, T, C))
        x = x + blk.mlp.proj(blk.mlp.act(blk.mlp.fc(blk.ln2(x))))
    return m.head(m.ln_f(x))


def decode(step, prompt, new: int, generator=None, forced=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's generation through ``step(idx, cache) -> logits``: the prompt in one pass, then a token at a time
    from the cache, mu from the FP32 log-softmax. Each token is drawn on the CPU with ``generator`` (as paths.sample
    draws), or taken from ``forced`` (batch, prompt + new; teacher-forced through the same cached path). Returns CPU
    (tokens, mu)."""
    cache, mus, tokens = [], [], prompt.cpu()
    with torch.no_grad():
        logits = step(prompt, cache)[:, -1]
        for t in range(new):
            logp = torch.log_softmax(logits.float(), dim=-1)
            if forced is None:
                nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator)
            else:
                nxt = forced[:, prompt.shape[1] + t, None].cpu()
            nxt_dev = nxt.to(logp.device)
            mus.append(logp.gather(-1, nxt_dev)[:, 0].cpu())
            tokens = torch.cat([tokens, nxt], dim=1)
            if t + 1 < new:
                logits = step(nxt_dev, cache)[:, -1]
    return tokens, torch.stack(mus, dim=1)


def learner_logprobs(model, tokens: torch.Tensor, fmt: str, device) -> torch.Tensor:
    """The training forward: the FP32 ``model`` (on ``device``) teacher-forced under the run's autocast (the lab's:
    torch.autocast, with the tensor-core contract on a CPU), log-probabilities of the generated tokens, on the CPU."""
    tokens = tokens.to(device)
    with torch.no_grad(), autocast_for(fmt, torch.device(device).type):
        logits = model(tokens[:, :-1])[:, PROMPT - 1:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, PROMPT:, None])[..., 0].cpu()


def native_sample(model, prompt, fmt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    m = native_model(model, fmt, device)
    return decode(lambda idx, cache: native_forward(m, idx, cache), prompt.to(device), NEW,
                  torch.Generator().manual_seed(SAMPLE_SEED))


def measure(model, learner, prompt, fmt: str, device) -> dict:
    """One format's numbers (module docstring); ``model`` FP32 on the CPU, ``learner`` its copy on ``device``."""
    t0 = time.perf_counter()
    tokens, mu = native_sample(model, prompt, fmt, device)
    pi = learner_logprobs(learner, tokens, fmt, device)
    native_s = time.perf_counter() - t0
    ctok, cmu = paths.sample(model, prompt, NEW, paths.engine(fmt), torch.Generator().manual_seed(SAMPLE_SEED))
    contract = mismatch(cmu, paths.logprobs(model, ctok, PROMPT, paths.learner(fmt)))
    engine = paths.engine(fmt)
    _, emu = decode(lambda idx, cache: paths.forward(model, idx, engine, cache), prompt, NEW, forced=tokens)
    epi = paths.logprobs(model, tokens, PROMPT, paths.learner(fmt))
    return {"native": mismatch(mu, pi), "contract": contract,
            "native_vs_emulated_engine": mismatch(emu, mu), "autocast_vs_emulated_learner": mismatch(epi, pi),
            "same_tokens_native_contract": float((tokens[:, PROMPT:] == ctok[:, PROMPT:]).double().mean()),
            "native_seconds": native_s}


def run(device: str) -> dict:
    t0 = time.perf_counter()
    # FP32 as every lab run sets it (the learner is the lab's training forward): no TF32, cuBLAS's reduced-precision
    # reductions off; the sampler runs under the same settings, recorded below (this process ends after one run)
    set_true_fp32(device)
    set_fp32_reductions()
    model, prompt = setup()
    learner = copy.deepcopy(model).to(device)
    env = {"device": device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None,
           "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
           "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
           "model": "GPT vocab 256, context 64, 4 layers, 4 heads, width 128, seed 0",
           "prompts": [BATCH, PROMPT], "new_tokens": NEW}
    env["tf32"] = torch.backends.cuda.matmul.allow_tf32
    out = {fmt: measure(model, learner, prompt, fmt, device) for fmt in ("fp16", "bf16")}
    out["ratio_bf16_fp16"] = {k: out["bf16"][k]["abs_mean"] / out["fp16"][k]["abs_mean"] for k in ("native", "contract")}
    return {**env, **out, "seconds": time.perf_counter() - t0}


def table(res: dict) -> str:
    """By probability, then the main table last (gpu_check.sh keeps the last 12 lines of the output)."""
    bins = " / ".join(f"({lo:g}, {hi:g}]" for lo, hi in zip((0,) + PROB_BINS[:-1], PROB_BINS))
    lines = [f"| native, mean abs(d) by mu: {bins} (tokens) |", "|---|"]
    for fmt in ("fp16", "bf16"):
        lines.append(f"| {fmt}: " + " / ".join(f"{b['abs_mean']:.2g} ({b['tokens']})" if b["tokens"] else "—"
                                              for b in res[fmt]["native"]["by_prob"].values()) + " |")
    lines += [f"{res['device']} ({res['gpu'] or 'CPU'}), torch {res['torch']}, {res['seconds']:.1f} s",
              "| mean abs(d) | fp16 | bf16 | bf16 / fp16 |", "|---|---|---|---|"]
    names = {"native": f"native sampler vs autocast learner ({res['device']})",
             "contract": "contract: emulated engine vs emulated learner (cpu)",
             "native_vs_emulated_engine": "native vs emulated engine, same tokens",
             "autocast_vs_emulated_learner": "autocast vs emulated learner, same tokens"}
    for key, name in names.items():
        ratio = res["ratio_bf16_fp16"].get(key)
        lines.append(f"| {name} | {res['fp16'][key]['abs_mean']:.3g} | {res['bf16'][key]['abs_mean']:.3g} | "
                     + (f"{ratio:.2f} |" if ratio else "— |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu (the rehearsal)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA device")
    res = run(args.device)
    files.atomic_write_json(Path(args.out), res)  # the packing step sees the old file or the whole new one
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

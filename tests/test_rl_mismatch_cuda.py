"""benchmarks/gpu/rl_mismatch_cuda.py, the RL mismatch on real 16-bit kernels, rehearsed on the CPU: its native forward is
lab/models/gpt.py's function (FP32 in, the FP32 model's numbers out), its KV cache changes nothing but FP32's
accumulation order, its decoding draws as lab.rl.paths.sample draws, and the CPU run writes both formats."""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import load_benchmark

from lab.rl import paths
from lab.rl.mismatch import mismatch

bench = load_benchmark("gpu/rl_mismatch_cuda")


@pytest.fixture(scope="module")
def setup():
    return bench.setup()


def test_the_cpu_rehearsal_writes_both_formats(tmp_path, capsys):
    out = tmp_path / "sub" / "rl_mismatch.json"
    assert bench.main(["--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [p.name for p in out.parent.iterdir()] == ["rl_mismatch.json"]  # written whole: no temporary file left
    for fmt in ("fp16", "bf16"):
        for key in ("native", "contract", "native_vs_emulated_engine", "autocast_vs_emulated_learner"):
            m = res[fmt][key]
            assert m["tokens"] == 32 * 32 and math.isfinite(m["abs_mean"]) and m["abs_mean"] > 0, (fmt, key)
        assert 0 <= res[fmt]["same_tokens_native_contract"] <= 1
    for key in ("native", "contract"):  # bf16's unit roundoff is 8x fp16's: the ratio within 4x of it either way
        assert 2 <= res["ratio_bf16_fp16"][key] <= 32, key
    assert res["tf32"] is False and res["device"] == "cpu"
    assert "| native sampler vs autocast learner (cpu) |" in capsys.readouterr().out


def test_the_native_fp32_forward_is_the_models_function(setup):
    """With the format FP32 the native sampler is the FP32 model: its mu and the FP32 learner's pi agree to FP32's
    rounding, and its full pass gives GPT.forward's logits."""
    model, prompt = setup
    tokens, mu = bench.native_sample(model, prompt, "fp32", "cpu")
    pi = bench.learner_logprobs(model, tokens, "fp32", "cpu")
    assert mismatch(mu, pi)["abs_max"] < 1e-4
    with torch.no_grad():
        torch.testing.assert_close(bench.native_forward(bench.native_model(model, "fp32", "cpu"), tokens),
                                   model(tokens), atol=1e-5, rtol=1e-5)


def test_the_kv_cache_is_the_full_pass(setup):
    """Cached decoding in every shape the forward takes (the first chunk, single tokens, a later chunk: SDPA's
    explicit-mask branch) gives the logits of one full pass, to FP32's accumulation order."""
    model, prompt = setup
    m = bench.native_model(model, "fp32", "cpu")
    seq = torch.cat([prompt, torch.randint(0, 256, (prompt.shape[0], 40), generator=torch.Generator().manual_seed(3))], 1)
    cache, parts, at = [], [], 0
    with torch.no_grad():
        full = bench.native_forward(m, seq)
        for n in [16] + [1] * 8 + [8] + [1] * 24:
            parts.append(bench.native_forward(m, seq[:, at:at + n], cache))
            at += n
    assert at == seq.shape[1] and cache[0][0].shape[-2] == at
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_decode_draws_as_paths_sample_draws(setup):
    """The native and emulated samplers read one random stream: decode through the emulated engine is paths.sample,
    bit for bit, and teacher-forcing its own tokens gives its own mu."""
    model, prompt = setup
    engine = paths.engine("bf16")

    def step(idx, cache):
        return paths.forward(model, idx, engine, cache)
    want_tokens, want_mu = paths.sample(model, prompt, bench.NEW, engine, torch.Generator().manual_seed(2))
    tokens, mu = bench.decode(step, prompt, bench.NEW, torch.Generator().manual_seed(2))
    assert torch.equal(tokens, want_tokens) and torch.equal(mu, want_mu)
    assert torch.equal(bench.decode(step, prompt, bench.NEW, forced=tokens)[1], mu)

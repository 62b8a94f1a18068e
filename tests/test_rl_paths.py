"""The sampler and the learner as two rounding paths (lab/rl/paths.py) and their mismatch (lab/rl/mismatch.py).

A random 4-layer GPT (the lab's, lab/models/gpt.py), 32 prompts of 16 tokens, 32 tokens generated. What is asserted is
arithmetic, not one machine's bits: the same code in both paths gives exactly 0; FP32 in both gives FP32's noise;
the mismatch orders with the formats' unit roundoff (bf16's 2^-8 against fp16's 2^-11: about 8x); it grows with the
rounding points the paths do not share; and the learner's written-down points are those of the model under
autocast, up to FP32's accumulation-order noise.
"""
import math

import pytest
import torch

import lab
from lab.models.gpt import GPTConfig
from lab.rl import paths
from lab.rl.mismatch import mismatch

PROMPT, NEW = 16, 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPTConfig(vocab_size=256, context=64, n_layer=4, n_head=4, d_model=128).build().eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (32, PROMPT), generator=torch.Generator().manual_seed(1))


def run(model, prompt, sampler, learner):
    tokens, mu = paths.sample(model, prompt, NEW, sampler, torch.Generator().manual_seed(2))
    return tokens, mu, paths.logprobs(model, tokens, PROMPT, learner)


def test_the_same_code_in_both_paths_is_exactly_zero(model, prompt):
    tokens, _, pi = run(model, prompt, paths.engine("bf16"), paths.learner("bf16"))
    again = paths.logprobs(model, tokens, PROMPT, paths.learner("bf16"))
    m = mismatch(again, pi)
    assert m["abs_max"] == 0.0 and m["k1"] == 0.0 and m["k3"] == 0.0 and m["ess"] == 1.0


def test_fp32_in_both_paths_is_fp32s_noise(model, prompt):
    """The KV-cached decode and the full forward differ only by FP32's accumulation order."""
    _, mu, pi = run(model, prompt, paths.engine("fp32"), paths.learner("fp32"))
    m = mismatch(mu, pi)
    assert 0 < m["abs_max"] < 1e-5 and m["out_of_band"] == 0.0
    # and mu is the FP32 softmax of the drawn tokens: its probabilities sum to one over the vocabulary
    assert math.isfinite(m["k3"]) and m["k3"] >= 0


def test_the_mismatch_orders_with_the_formats_unit_roundoff(model, prompt):
    got = {fmt: mismatch(*run(model, prompt, paths.engine(fmt), paths.learner(fmt))[1:])["abs_mean"]
           for fmt in ("fp32", "fp16", "bf16")}
    assert got["fp32"] < got["fp16"] / 100 < got["bf16"] / 100
    assert 2 <= got["bf16"] / got["fp16"] <= 32  # 2^-8 / 2^-11 = 8, within 4x either way


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_the_mismatch_grows_with_the_rounding_points_the_paths_do_not_share(model, prompt, fmt):
    """Samplers that round where the learner does, plus ever more points it does not: eager attention's scores and
    probabilities, then the residual stream, then every parameter, the embedding and the LayerNorms (an inference
    engine). Only the KV cache and FP32's accumulation order separate the first from the learner."""
    extra = [set(), {"attn_scores", "attn_probs"}, {"residual"}, {"weights", "embed", "norm_out"}]
    grown, got = set(), []
    for points in extra:
        grown |= points
        got.append(mismatch(*run(model, prompt, paths.Rounding(fmt, paths.LEARNER | grown), paths.learner(fmt))[1:]))
    means = [m["abs_mean"] for m in got]
    assert 0 < means[0] < means[1] < means[2] < means[3], means
    assert means[3] > 2 * means[0]
    # the engine is the last sampler with its attention fused (FP32 scores and probabilities, as the learner's)
    assert paths.engine(fmt).points == paths.LEARNER | grown - {"attn_scores", "attn_probs"}


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_the_learners_points_are_those_of_the_model_under_autocast(model, prompt, fmt):
    """LEARNER written down against the lab's GPT run under lab.autocast (CPU autocast + the tensor-core contract, the
    training forward): they differ by FP32 accumulation order only, the size of the KV cache's own difference, and
    well below the engine's mismatch. (Rounding the residual stream in the learner, as an engine does, fails this.)"""
    tokens, mu, pi = run(model, prompt, paths.engine(fmt), paths.learner(fmt))
    with torch.no_grad(), lab.autocast("cpu", fmt):
        logits = model(tokens[:, :-1])[:, PROMPT - 1:]
    real = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, PROMPT:, None])[..., 0]
    cache_noise = mismatch(*run(model, prompt, paths.Rounding(fmt, paths.LEARNER), paths.learner(fmt))[1:])
    assert mismatch(real, pi)["abs_mean"] <= 3 * cache_noise["abs_mean"]
    assert mismatch(real, pi)["abs_mean"] < 0.5 * mismatch(mu, pi)["abs_mean"]


def test_mismatch_statistics_by_hand():
    log_mu = torch.log(torch.tensor([[0.5, 0.25, 0.005, 0.9]]))
    d = torch.tensor([[0.0, 0.3, -1.0, 0.1]])
    m = mismatch(log_mu, log_mu + d)
    w = d.double().exp()
    assert m["tokens"] == 4 and m["abs_max"] == pytest.approx(1.0) and m["abs_mean"] == pytest.approx(0.35)
    assert m["k1"] == pytest.approx(-float(d.mean()))  # mean(log mu - log pi)
    assert m["k3"] == pytest.approx(float((w - 1 - d.double()).mean()))
    assert m["out_of_band"] == pytest.approx(0.5) and m["out_of_half_double"] == pytest.approx(0.25)
    assert m["ess"] == pytest.approx(float(w.sum() ** 2 / (4 * (w * w).sum())))
    assert m["by_prob"]["(0, 0.01]"]["tokens"] == 1 and m["by_prob"]["(0, 0.01]"]["abs_mean"] == pytest.approx(1.0)
    assert m["seq_abs_mean"] == pytest.approx(abs(float(d.sum())))
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch(log_mu, log_mu[:, :2])


def test_bad_paths_are_refused_with_what_is_accepted():
    with pytest.raises(ValueError, match="format must be one of fp32, bf16, fp16"):
        paths.Rounding("fp8")
    with pytest.raises(ValueError, match="unknown rounding point"):
        paths.Rounding("fp16", frozenset({"everything"}))
    with pytest.raises(ValueError, match="unknown fusion"):
        paths.engine("fp16", ("attention_and_more",))


def test_the_decode_benchmark_compares_like_with_like(model, prompt):
    """benchmarks/speed/bench_rl_decode.py's bare KV-cache decode and the FP32 sampler draw the same tokens from the same
    generator: the two time the same work."""
    from conftest import load_benchmark
    bench = load_benchmark("speed/bench_rl_decode")
    bare = bench.bare_decode(model, prompt[:4], 8, torch.Generator().manual_seed(2))
    tokens, _ = paths.sample(model, prompt[:4], 8, paths.engine("fp32"), torch.Generator().manual_seed(2))
    # tokens, not logits: the two paths' FP32 probabilities differ by rounding only (different attention and softmax
    # kernels), so a token differs only where a draw lands within ~1e-6 of a boundary of its distribution
    assert torch.equal(bare, tokens)

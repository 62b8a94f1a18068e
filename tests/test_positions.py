"""Gradients by position (lab/numerics/positions.py): the measurement against a reference written out here (the GPT's
forward by hand, in FP64, FP32 and FP16 under the contract), FP16's range against mathematics, the attention's FP16
accumulation against a correctly rounded emulation, the pooling, and gradient checkpointing bit for bit (the
measurement, and training with train.gradient_checkpointing)."""
from __future__ import annotations

import contextlib
import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import lab
from lab.core.config import ConfigError, resolve_run, validate_study
from lab.models.gpt import GPTConfig
from lab.numerics import positions as P
from lab.numerics.contract_reference import round_to
from lab.report import positions_table
from lab.run.train import train

from conftest import tiny_study

V, T, B = 64, 16, 3


def model():
    torch.manual_seed(0)
    m = GPTConfig(vocab_size=V, context=T, n_layer=2, n_head=4, d_model=32).build()
    with torch.no_grad():  # trained-looking weights: larger than the initialisation's, so gradients spread
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def by_hand(m, idx, targets, precision, divisor, scale):
    """The stream's and every block's qkv gradient, the GPT's forward written out (lab/models/gpt.py)."""
    ctx = lab.autocast("cpu", torch.float16) if precision == "fp16" else contextlib.nullcontext()
    with ctx:
        h0 = m.tok(idx) + m.pos(torch.arange(idx.shape[1]))
        h, qkvs = h0, []
        for b in m.blocks:
            qkv = b.attn.qkv(b.ln1(h))
            qkvs.append(qkv)
            Bn, Tn, C = h.shape
            q, k, v = qkv.view(Bn, Tn, 3, b.attn.n_head, C // b.attn.n_head).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + b.attn.proj(y.transpose(1, 2).reshape(Bn, Tn, C))
            h = h + b.mlp(b.ln2(h))
        logits = m.head(m.ln_f(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / divisor
    loss = loss * torch.full((), scale, dtype=loss.dtype)
    g = torch.autograd.grad(loss, [h0, *qkvs])
    return {"stream": g[0], "qkv": torch.cat(g[1:], -1)}


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 12])
def test_the_table_is_the_gradients_written_out_by_hand(scale):
    """Norms, errors and counts per position from the model run by hand in FP64, FP32 and FP16 (at the scale): the
    hooks capture the right tensors, and the scale and the loss's divisor are applied as a training step does."""
    m, (idx, tgt), divisor = model(), batch(), 32
    table = P.position_gradients(m, idx, tgt, scale=scale, divisor=divisor)
    ref = by_hand(copy.deepcopy(m).double(), idx, tgt, "fp64", divisor, 1.0)
    for path, s in (("fp32", 1.0), ("fp16", scale)):
        got = by_hand(m, idx, tgt, path, divisor, s)
        for tensor in ("stream", "qkv"):
            rows = table[(table.tensor == tensor) & (table.path == path)].set_index("position")
            g, r = got[tensor], ref[tensor]
            d = g.double() / s - r
            np.testing.assert_allclose(rows["ref_norm"], r.pow(2).sum((0, 2)).sqrt(), rtol=1e-12)
            np.testing.assert_allclose(rows["err_norm"], d.pow(2).sum((0, 2)).sqrt(), rtol=1e-12)
            nonzero = r.abs() > P.NOISE * r.abs().max()
            assert rows["nonzero"].tolist() == nonzero.sum((0, 2)).tolist()
            assert rows["flushed"].tolist() == (nonzero & (g == 0)).sum((0, 2)).tolist()
            tiny = torch.finfo(g.dtype).tiny
            assert rows["subnormal"].tolist() == ((g != 0) & (g.abs() < tiny)).sum((0, 2)).tolist()
    fp16 = table[table.path == "fp16"]
    assert (fp16.rel_err > 1e-5).all() and (table[table.path == "fp32"].rel_err < 1e-5).all()


def test_a_scale_that_puts_every_value_under_half_the_smallest_subnormal_flushes_all():
    """At S with |g64 x S| < 2^-25 everywhere, FP16 must hold every attention gradient as 0: all flushed, the
    relative error exactly 1 at every position."""
    m, (idx, tgt) = model(), batch()
    ref = by_hand(copy.deepcopy(m).double(), idx, tgt, "fp64", 1, 1.0)["qkv"]
    scale = 2.0 ** -40
    assert (ref.abs() * scale < 2.0 ** -25).all()
    qkv = P.position_gradients(m, idx, tgt, scale=scale, precisions=("fp16",)).query("tensor == 'qkv'")
    assert (qkv.flushed == qkv.nonzero).all() and (qkv.nonzero > 0).all()
    assert (qkv.subnormal == 0).all() and (qkv.overflow == 0).all()
    np.testing.assert_array_equal(qkv.rel_err, 1.0)


def test_the_model_is_left_as_it_was():
    m, (idx, tgt) = model(), batch()
    m.train()
    before = [p.detach().clone() for p in m.parameters()]
    P.position_gradients(m, idx, tgt, scale=1024.0)
    assert m.training and all(p.grad is None for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_checkpointed_blocks_measure_bit_for_bit_the_same(precision):
    """lab.checkpoint recomputes each block under the forward's contract: the same gradients, bit for bit."""
    (idx, tgt), plain, ckpt = batch(), model(), model()
    ckpt.checkpoint_blocks = True
    a = P.position_gradients(plain, idx, tgt, scale=2.0 ** 16, divisor=32, precisions=("fp32", precision))
    b = P.position_gradients(ckpt, idx, tgt, scale=2.0 ** 16, divisor=32, precisions=("fp32", precision))
    pd.testing.assert_frame_equal(a, b, check_exact=True)


# --- the attention's paths -------------------------------------------------------------------------------------
def operands(t=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, t, d, generator=g).half() for _ in range(3)]


def exp_fixed(x: torch.Tensor) -> torch.Tensor:
    """exp of each value, by one scalar function (Python's math.exp) rounded once to x's dtype: the exponential that
    both _attention_accum16 and its reference take. FP16 has no exp of its own and torch's (FP32's, rounded) is a
    kernel's approximation, which differs between ATen's CPU capabilities (AVX-512's and the default path's give
    different FP16 values for some inputs); the test's claim is the rounding of every +, x and /, which holds for any
    exp both sides share."""
    exact = torch.tensor([math.exp(v) for v in x.double().flatten().tolist()], dtype=torch.float64)
    return round_to(exact.reshape(x.shape), x.dtype).to(x.dtype)


def accum16_reference(q, k, v):
    """Every operation correctly rounded to FP16 from its exact FP64 value (round_to: one rounding), in the order
    _attention_accum16 promises: scores summed over the head dimension in order, the row sum and P @ V over the keys
    in order; the exponential exp_fixed's."""
    r = lambda x: round_to(x, torch.float16)  # noqa: E731
    q, k, v = (x.double() for x in (q, k, v))
    Bn, H, Tn, d = q.shape
    out = torch.zeros(Bn, H, Tn, d, dtype=torch.float64)
    for i in range(Tn):
        s = torch.zeros(Bn, H, i + 1, dtype=torch.float64)
        for c in range(d):
            s = r(s + r(q[:, :, i, c:c + 1] * k[:, :, :i + 1, c]))
        s = r(s * (1 / math.sqrt(d)))
        e = exp_fixed(r(s - s.amax(-1, keepdim=True)).half()).double()
        total = torch.zeros(Bn, H, dtype=torch.float64)
        for j in range(i + 1):
            total = r(total + e[..., j])
        p = r(e / total.unsqueeze(-1))
        acc = torch.zeros(Bn, H, d, dtype=torch.float64)
        for j in range(i + 1):
            acc = r(acc + r(p[..., j:j + 1] * v[:, :, j]))
        out[:, :, i] = acc
    return out


def test_fp16_accumulation_is_every_step_rounded_once(monkeypatch):
    """Torch's CPU FP16 arithmetic (each +, x and / in FP32, rounded once) is the correctly rounded FP16 result, as the
    emulation from exact FP64 values says, bit for bit, in the order promised: correctly rounded results are unique,
    whichever kernel computed them. The exponential (not correctly rounded by torch's kernels) is one fixed function
    on both sides."""
    q, k, v = operands(t=12, d=16)
    monkeypatch.setattr(P.torch, "exp", exp_fixed)  # what _attention_accum16 calls; the reference calls it directly
    out = P._attention_accum16(q, k, v)
    monkeypatch.undo()
    assert torch.equal(out.double(), accum16_reference(q, k, v))


def test_the_contract_rounds_the_attention_once_and_fp16_sums_lose_more_at_the_tail():
    """The contract's output is FP64's rounded once (relative error at most 2^-11 per element, plus FP32's); summing
    in FP16 loses more, and more at the last positions than at the first."""
    q, k, v = operands(t=256)
    table = P.attention_paths(q, k, v).set_index(["path", "position"])["rel_err"]
    assert (table["contract"] <= 2.0 ** -11 * 1.01).all()
    assert (table["probs16"] <= 2.0 ** -10).all()
    tail, head = table["accum16"].iloc[-64:].mean(), table["accum16"].iloc[:64].mean()
    assert tail > 2 * head > 2 * table["contract"].iloc[:64].mean()


# --- pooling ------------------------------------------------------------------------------------------------------
def test_tail_and_head_pool_the_sums_of_their_positions():
    rows = pd.DataFrame({"tensor": "stream", "path": "fp16", "position": range(8),
                         "ref_norm": [1, 2, 3, 4, 5, 6, 7, 8.0], "err_norm": [1, 0, 0, 0, 0, 0, 3, 4.0],
                         "n": 10, "nonzero": 10, "flushed": [0, 0, 0, 0, 0, 0, 1, 3], "subnormal": [2] + [0] * 7,
                         "overflow": 0})
    rows["rel_err"], rows["ref_rms"] = rows.err_norm / rows.ref_norm, rows.ref_norm / math.sqrt(10)
    got = P.tail_head(rows[P.COLUMNS])
    assert got["pos_stream_fp16_rel_err_tail"] == pytest.approx(math.sqrt((9 + 16) / (49 + 64)))
    assert got["pos_stream_fp16_rel_err_head"] == pytest.approx(1 / math.sqrt(5))
    assert got["pos_stream_fp16_flushed_tail"] == pytest.approx(4 / 20)
    assert got["pos_stream_fp16_subnormal_head"] == pytest.approx(2 / 20)
    assert got["pos_stream_fp16_rel_err_ratio"] == pytest.approx(math.sqrt(25 / 113) * math.sqrt(5))


# --- training: train.gradient_checkpointing and train.position_probe -------------------------------------------------
def lm_run(tmp_path, name, mode_def, **train_settings):
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny",
                              "data": {"name": "pydoc", "context": 32, "vocab_size": 256, "val_fraction": 0.1}}}
    study["modes"] = {name: mode_def}
    study["train"].update(epochs=1, max_steps=4, batch_size=8, census_every=0, emulated_accum=32,
                          position_probe=True, **train_settings)
    out = tmp_path / "runs" / name
    return train(resolve_run(validate_study(study), "lm", name, 0), out), out


def test_training_with_checkpointing_is_bit_for_bit_training_without(tmp_path):
    """The same steps, the same final model, the same probe; the positions table says so."""
    mode = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    a, da = lm_run(tmp_path, "plain", mode)
    b, db = lm_run(tmp_path, "ckpt", {**mode, "train": {"gradient_checkpointing": True}})
    assert (da / "steps.csv").read_bytes() == (db / "steps.csv").read_bytes()
    assert (da / P.FILE).read_bytes() == (db / P.FILE).read_bytes()
    assert a["final_val_loss"] == b["final_val_loss"] and a["pos_scale"] == b["pos_scale"] == 2.0 ** 16
    assert {k: v for k, v in a.items() if k.startswith("pos_")} == {k: v for k, v in b.items() if k.startswith("pos_")}
    per_run, _ = positions_table.load([tmp_path / "runs"])
    assert bool(per_run.set_index("mode").loc["ckpt", "same_as_unchecked"])


def test_the_positions_table_tells_a_different_run_apart(tmp_path):
    """A checkpointed run whose unchecked twin's probe differs (one number changed here) is not 'the same'."""
    lm_run(tmp_path, "plain", {"precision": "fp16", "scaler": {"policy": "static", "scale": 1024}})
    lm_run(tmp_path, "ckpt", {"precision": "fp16", "scaler": {"policy": "static", "scale": 1024},
                              "train": {"gradient_checkpointing": True}})
    (tmp_path / "runs" / "plain" / P.FILE).write_text((tmp_path / "runs" / "plain" / P.FILE).read_text()
                                                      .replace("stream,fp16,0,", "stream,fp16,0,1"))
    per_run, _ = positions_table.load([tmp_path / "runs"])
    assert not bool(per_run.set_index("mode").loc["ckpt", "same_as_unchecked"])


def test_checkpointing_a_model_without_blocks_is_refused_before_anything_is_written(tmp_path):
    study = tiny_study()
    study["models"] = {"resnet50": {"preset": "resnet50-digits"}}
    study["train"]["gradient_checkpointing"] = True
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        train(resolve_run(validate_study(study), "resnet50", "fp32", 0), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_damaged_positions_file_is_refused_in_one_line(tmp_path, capsys):
    from lab.cli import main
    _, out = lm_run(tmp_path, "plain", {"precision": "fp32"})
    text = (out / P.FILE).read_text()
    (out / P.FILE).write_text(text[:len(text) // 2])  # cut inside a line, as a copy taken while it was written
    assert main(["positions-table", str(out), "--csv", str(tmp_path / "p.csv"), "--md", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and P.FILE in err[0] and "cut short" in err[0]

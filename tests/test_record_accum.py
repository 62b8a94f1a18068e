"""Gradient accumulation in `lab.record`: the micro-batches of an optimizer step are counted (backward passes through
the model), recorded (config.yaml, steps.csv), and the census compares like with like: a replay of the step's last
micro-batch against that micro-batch's own FP16 gradients (lab/numerics/micro.py, lab/numerics/monitor.py). Each
share is checked against one computed outside the recorder, from hooks on the same model and batch."""
import csv

import pytest
import torch
import yaml

import lab
from lab.diagnose import diagnose, format_text
from lab.numerics.precision import autocast_for

VOCAB, CONTEXT = 256, 16


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, CONTEXT), generator=g) for _ in range(n)]


def outside_shares(model, x, divisor, scale=1.0, loss_fn=None):
    """Of the gradient values FP32 holds non-zero in one micro-batch's backward (loss / divisor x scale), the share
    FP16 holds as zero: activation gradients (each leaf module's output, a tensor counted once however many modules
    pass it on) and parameter gradients (this backward's alone). Computed with plain hooks, apart from the lab.
    ``loss_fn(model)``: the micro-batch's loss as a framework computes it (already divided), instead of x's."""
    def grads(fp16):
        acts, seen, handles, keep = [], set(), [], []

        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            # the autograd node's Python object kept alive, as the lab's monitor keeps it: one made afresh at each
            # access of t.grad_fn can have another id() each time (or another node's), so the same tensor would
            # count twice, or two once (seen under torch 2.11)
            keep.append(t.grad_fn)
            key = (t.data_ptr(), tuple(t.shape), t.stride(), id(keep[-1]))
            if isinstance(t, torch.Tensor) and t.requires_grad and key not in seen:
                seen.add(key)
                t.register_hook(lambda g: acts.append(g.detach().clone()))
        for m in model.modules():
            if next(m.children(), None) is None:
                handles.append(m.register_forward_hook(hook))
        model.zero_grad(set_to_none=True)
        with autocast_for("fp16" if fp16 else "fp32", "cpu"):
            loss = loss_fn(model) if loss_fn else model(input_ids=x, labels=x).loss / divisor
        (loss * scale).backward()
        for h in handles:
            h.remove()
        params = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return acts, params

    (a16, p16), (a32, p32) = grads(True), grads(False)

    def counts(low, full):  # (FP16 zeros, FP32 zeros, FP32 non-zeros)
        assert sum(t.numel() for t in low) == sum(t.numel() for t in full)
        return (sum(int((t == 0).sum()) for t in low), sum(int((t == 0).sum()) for t in full),
                sum(int((t != 0).sum()) for t in full))
    return {"activation_grad": counts(a16, a32), "param_grad": counts(p16, p32)}


def share(*counted):
    """The share FP16 held as zero of what FP32 keeps, over one or more micro-batches' counts."""
    z16, z32, nonzero = (sum(c[i] for c in counted) for i in range(3))
    return (z16 - z32) / nonzero


def train(model, scaler, out, data, accum, steps=1, replay_all=False, **record_kw):
    """The usual accumulating loop: loss / accum per micro-batch, unscale_, clip, step, update, one rec.step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"step": []}

    def replay():  # the last micro-batch again (or the whole step's), as a user writes it
        for x in (batch["step"] if replay_all else batch["step"][-1:]):
            with autocast_for("fp16", "cpu"):
                loss = model(input_ids=x, labels=x).loss / accum
            scaler.scale(loss).backward()
    with lab.record(model, scaler, out=out, optimizer=opt, replay=replay, census_every=1, **record_kw) as rec:
        for step in range(steps):
            batch["step"] = data[step * accum:(step + 1) * accum]
            for x in batch["step"]:
                with autocast_for("fp16", "cpu"):
                    loss = model(input_ids=x, labels=x).loss / accum
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)


def census_shares(out, step=0):
    """The recording's census at ``step``: (FP16 rows, FP32-replay rows) of each source's __total__, and the share."""
    with open(out / "census.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["layer"] == "__total__" and int(r["step"]) == step]
    shares = {}
    for source in ("activation_grad", "param_grad"):
        own = next(r for r in rows if r["source"] == source and r["grads"] == "fp16")
        rep = next(r for r in rows if r["source"] == source and r["grads"] == "fp32")
        assert own["total"] == rep["total"]  # the same values counted on both sides
        shares[source] = (int(own["zero"]) - int(rep["zero"])) / (int(rep["total"]) - int(rep["zero"]))
    return shares


@pytest.mark.parametrize("accum", [1, 4, 64])
def test_the_replayed_micro_batch_is_compared_with_its_own_fp16_census(tmp_path, accum):
    """GradScaler at scale 1 (FP16 without a scale), the loss / accum: the recording's flushed shares at step 0 are
    the last micro-batch's, as measured outside; config.yaml and steps.csv say how many micro-batches the step had."""
    model, data = gpt2(), tokens(accum)
    expected = {k: share(v) for k, v in outside_shares(model, data[-1], accum).items()}
    assert expected["activation_grad"] > (0.01 if accum == 64 else 0)  # the case has something to measure
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    train(model, scaler, tmp_path / "rec", data, accum)
    got = census_shares(tmp_path / "rec")
    for source in expected:
        assert got[source] == pytest.approx(expected[source], abs=1e-3), source
    config = yaml.safe_load((tmp_path / "rec" / "config.yaml").read_text())
    assert config["train"]["accum_steps"] == accum
    with open(tmp_path / "rec" / "steps.csv") as f:
        assert [r["micro_batches"] for r in csv.DictReader(f)] == [str(accum)]
    d = diagnose(tmp_path / "rec")
    for source, v in d.fp16_loss["sources"].items():
        assert 0 <= v["flushed"] <= 1
    assert d.fp16_loss["sources"]["activation_grad"]["flushed"] == pytest.approx(expected["activation_grad"], abs=1e-3)
    assert all(0 < v <= 1 for v in d.fp16_loss["layers"].values())
    text = format_text(d)
    assert "%" in text and not any(float(w.rstrip("%),;")) > 100 for w in text.split() if w.endswith("%")
                                   and w.rstrip("%),;").replace(".", "").isdigit())
    # (karpathy/nanoGPT's loop at scale 1, 64 micro-batches): precision judged, and the verdict never
    # contradicts its first advice
    act = d.fp16_loss["sources"]["activation_grad"]
    assert act["flushed"] <= act["coarse"] <= 1
    first = d.recommendations[0]
    if d.verdict == "healthy":
        assert first.code == "healthy" or first.action.startswith("Optional"), text
    else:
        assert first.code != "healthy", text


def test_a_replay_of_the_whole_step_is_compared_with_every_micro_batch(tmp_path):
    """A replay that runs all of the step's micro-batches: both sides count all of them (a lab scaler at scale 1, 4
    micro-batches of loss / 4; the weights are step 0's for each, so the outside counts add up over them)."""
    model, data = gpt2(), tokens(4)
    each = [outside_shares(model, x, 4) for x in data]
    scaler = lab.scaling.create("static", device="cpu", scale=1.0)
    train(model, scaler, tmp_path / "rec", data, 4, replay_all=True)
    got = census_shares(tmp_path / "rec")
    for source in got:
        assert got[source] == pytest.approx(share(*(e[source] for e in each)), abs=1e-3), source
    assert got["activation_grad"] > 0


def test_accumulation_declared_and_detected(tmp_path):
    """accum_steps= declared: recorded as declared, and a step that ran another count is said once; bad values are
    refused with the rule."""
    model, data = gpt2(), tokens(6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with pytest.warns(UserWarning, match="ran 3 backward passes through the model, accum_steps=2 was declared"):
        train(model, scaler, tmp_path / "rec", data, 3, steps=2, accum_steps=2)
    config = yaml.safe_load((tmp_path / "rec" / "config.yaml").read_text())
    assert config["train"]["accum_steps"] == 2
    for bad in (0, 1.5, True):
        with pytest.raises(lab.run.record.RecordError, match="accum_steps must be an int >= 1"):
            lab.record(model, scaler, out=tmp_path / f"bad{bad}", accum_steps=bad)


def test_gradients_wholly_below_fp16_s_normal_range_are_not_called_healthy(tmp_path):
    """A GPT loop as nanoGPT's: 64 micro-batches of 512 tokens, GradScaler at scale 1. Nearly
    every activation gradient FP32 keeps lies below FP16's normal range, under 20% of them flushed and under 95%
    subnormal (the old rules' two thresholds: once "healthy", with "use a higher loss scale" as its first advice);
    held with fewer bits than BF16 they pass COARSE_MATERIAL: a warning, the raise first."""
    from lab.diagnose.underflow import FLUSH_MATERIAL, SUBNORMAL_MOST
    g = torch.Generator().manual_seed(0)
    model, data = gpt2(), [torch.randint(0, VOCAB, (32, CONTEXT), generator=g) for _ in range(64)]
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    train(model, scaler, tmp_path / "rec", data, 64)
    d = diagnose(tmp_path / "rec")
    act = d.fp16_loss["sources"]["activation_grad"]
    assert act["flushed"] < FLUSH_MATERIAL and act["subnormal"] < SUBNORMAL_MOST < act["flushed"] + act["subnormal"]
    assert d.verdict != "healthy", format_text(d)
    assert d.recommendations[0].code == "raise_scale" and not d.recommendations[0].action.startswith("Optional")

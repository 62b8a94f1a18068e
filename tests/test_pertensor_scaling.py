"""Per-block scaling of FP16's backward (lab/scaling/pertensor.py): each block's gradients at their own power-of-two
scale, unscaled per block before the engine's unscale_. Against an FP64 reference on a chain whose early blocks'
gradients are far smaller than its late ones: the gradients are the true ones up to FP16 rounding, and values the
largest single loss scale flushes survive; an overflow still skips the step; a killed run resumes exactly."""
import io
import re

import pytest
import torch
from torch import nn

import lab.scaling
from lab.core.config import resolve_run
from lab.models.presets import create_model
from lab.run import checkpoint
from lab.run.train import train
from lab.scaling.base import ScalingConfigError

import test_resume


class Shrink(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``f``: a block whose own gradients are ``f`` smaller."""

    @staticmethod
    def forward(ctx, x, f):
        ctx.f = f
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.f, None


class Block(nn.Module):
    def __init__(self, width: int, f: float):
        super().__init__()
        self.lin, self.f = nn.Linear(width, width), f

    def forward(self, x):  # the FP16 linear's output back in FP32 (the stream between blocks, as a GPT's)
        y = Shrink.apply(self.lin(x), self.f)
        return y.float() if y.dtype == torch.float16 else y


class Chain(nn.Module):
    """stem -> 4 blocks -> head; going down, each block's gradients shrink 2^-8 more (block 0: 2^-32 of the top)."""

    def __init__(self, width: int = 32, n: int = 4):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, 2.0 ** -8) for _ in range(n))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def data():
    torch.manual_seed(0)
    return Chain(), torch.randn(64, 32), torch.randint(0, 4, (64,))


def fp64_grads(model, x, y) -> dict:
    ref = Chain().double()
    ref.load_state_dict(model.state_dict())
    nn.functional.cross_entropy(ref(x.double()), y).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def fp16_grads(model, x, y, scale: float, per_tensor, steps: int = 2):
    """Unscaled gradients after ``steps`` steps at a static scale (lr 0: the same weights each step, so the per-block
    scales have a history by the last one); the scaler too."""
    m = Chain()
    m.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = lab.scaling.create("static", scale=scale, device="cpu", per_tensor=per_tensor)
    if scaler.per_tensor is not None:
        scaler.per_tensor.attach(m)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = nn.functional.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return {n: p.grad for n, p in m.named_parameters()}, scaler


def flushed(grads: dict, ref: dict, prefix: str) -> int:
    """Values FP64 holds non-zero that came out zero."""
    return sum(int(((grads[n] == 0) & (ref[n] != 0)).sum()) for n in ref if n.startswith(prefix))


def largest_clean_scale(model, x, y) -> float:
    """The largest power of two one loss scale can take here without overflowing (where GradScaler settles)."""
    best = 1.0
    for k in range(0, 40):
        grads, scaler = fp16_grads(model, x, y, 2.0 ** k, None, steps=1)
        if scaler.last_found_inf:
            break
        best = 2.0 ** k
    return best


def test_gradients_are_the_fp64_ones_up_to_fp16_rounding():
    model, x, y = data()
    ref = fp64_grads(model, x, y)
    # the stem too: outside the boundaries it would stay at the loss scale, where its 2^-32 gradients flush
    chain = {"boundaries": ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]}
    grads, scaler = fp16_grads(model, x, y, 1024.0, chain)
    assert scaler.per_tensor.cums.max() > 1  # the blocks ran at scales of their own
    for name, r in ref.items():
        err = (grads[name].double() - r).abs().max() / r.abs().max()
        assert err < 4e-3, name  # a few FP16 roundings (2^-11 each)


def test_values_the_largest_single_scale_flushes_survive_per_block_scales():
    model, x, y = data()
    ref = fp64_grads(model, x, y)
    scale = largest_clean_scale(model, x, y)
    single, _ = fp16_grads(model, x, y, scale, None)
    per_block, scaler = fp16_grads(model, x, y, scale, True)
    assert not scaler.last_found_inf
    assert flushed(single, ref, "blocks.0") > 0  # GradScaler's one scale loses the first block's small values
    assert flushed(per_block, ref, "blocks.0") < flushed(single, ref, "blocks.0")
    assert flushed(per_block, ref, "") < flushed(single, ref, "")


def test_an_overflow_still_skips_the_step_and_halves_the_blocks_scales():
    model, x, y = data()
    m = Chain()
    m.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = lab.scaling.create("dynamic", init_scale=1024.0, device="cpu", per_tensor=True)
    scaler.per_tensor.attach(m)
    for bad in (False, False, True):
        before = [p.detach().clone() for p in m.parameters()]
        opt.zero_grad()
        with torch.autocast("cpu", torch.float16):
            out = m(x)
            if bad:  # a gradient too large for FP16 in the top block's weights
                out = out + m.blocks[3].lin(x).float().sum() * 1e30
            loss = nn.functional.cross_entropy(out, y)
        cums = scaler.per_tensor.cums.clone()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.last_step_skipped
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))  # the skipped step changed nothing
    scaler.scale(torch.ones(()))  # the next step's scales: the top block's at most half of what overflowed
    assert scaler.per_tensor.cums[3] <= cums[3] / 2


def test_gpt_blocks_and_its_tied_weight():
    gpt = create_model("gpt-tiny", num_classes=64, in_chans=1, input_size=8)
    scaling = lab.scaling.create("dynamic", device="cpu", per_tensor=True).per_tensor.attach(gpt)
    assert len(scaling.groups) == 2  # blocks.0, blocks.1; the tied embedding and head stay at the loss scale
    scaling.detach()
    with pytest.raises(ValueError, match="also used outside the blocks"):
        lab.scaling.create("dynamic", device="cpu", per_tensor={"boundaries": ["tok", "blocks.0"]}).per_tensor.attach(gpt)


@pytest.mark.parametrize("bad", [{"margin": -1}, {"history": 0}, {"every": 2}, {"boundaries": []}, "yes"])
def test_settings_are_checked_without_torch(bad):
    with pytest.raises(ScalingConfigError, match="per_tensor"):
        lab.scaling.check("dynamic", per_tensor=bad)


def test_killed_run_resumes_exactly(tmp_path):
    """The ResNet's stages as blocks, overflowing at 2^40 (skips, halved scales in the history), 2 micro-batches a
    step, a census with its FP32 replay and attribution replays every 2 steps: killed, resumed, identical."""
    mode = "pertensor-skips"
    test_resume.MODES[mode] = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0 ** 40,
                                                               "backoff_factor": 2.0 ** -10, "per_tensor": True}}
    ref_dir = tmp_path / "reference"
    train(resolve_run(test_resume.study(mode), "resnet50", mode, 0), ref_dir, progress=io.StringIO())
    reference = test_resume.run_files(ref_dir)
    files, _ = test_resume.killed_then_resumed(tmp_path, mode, "micro:9")
    for name in ("steps.csv", "census.csv", "grad_hist.csv"):
        assert files[name] == reference[name], name
    assert files["metrics"] == reference["metrics"]
    assert reference["metrics"]["skipped_steps"] > 0

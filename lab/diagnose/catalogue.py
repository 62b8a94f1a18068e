"""The catalogue of FP16 failures with known causes (docs/diagnose.md, "The catalogue"): each a real training loop
written as a user writes one, recorded with ``lab.record``, FP16 on the CPU under the tensor-core contract.
tests/test_diagnose_catalogue.py checks that ``lab diagnose`` names each cause; the alert-threshold study
(lab/study/alerts.py, docs/alerts.md) records the same loops (``record_catalogue``) as planted failures whose outcome
is known by construction (``Scenario.ends_worse``).

Each scenario is taken from a real report:

* forward overflow: huggingface/transformers#5651 (T5's ``wo`` output 66246 > 65504, then a NaN loss);
* a backward that overflows at every scale: deepspeedai/DeepSpeed#697 ("Attempted loss scale: 1, reducing to 1",
  the model does not learn), facebookresearch/fairseq#512 (the scale halves to 0.0001 and the run ends);
* underflow at scale 1: engichang1467/Open-Rig3R#35 (FP16 autocast without a scaler: gradients silently zero);
* underflow hidden by a too-small static scale: tensorflow/tensorflow#38357 (a loss scale below 1), fairseq#515;
* a learning rate too high, FP32 diverging as well: facebookresearch/detr#285, OpenNMT/OpenNMT-tf#744;
* a mid-run loss spike, one overflow the scaler handles: deepspeedai/DeepSpeed#931 (overflows again at step 500);
* stuck LoRA adapters over an FP16 base: huggingface/peft#1522 (an FP16 base under LoRA, the loss goes wrong);
* a healthy run: NVIDIA/apex#864 ("Gradient overflow. Skipping step" now and then is the scaler working).

Imports torch (the loops are models): lab.diagnose's own modules never import this one.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

import lab
import lab.scaling

STEPS = 40


class MLP(torch.nn.Module):
    def __init__(self, width=32, out=4, act=torch.relu, norm=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width) if norm else torch.nn.Identity()
        self.head = torch.nn.Linear(width, out)
        self.act = act

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.fc2(self.act(self.fc1(x))))))


def classes(n=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 16, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def regression(n=STEPS, seed=0, spike_at=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g) / 4
    out = []
    for i in range(n):
        x = torch.randn(16, 16, generator=g)
        y = x @ w
        if i == spike_at:
            y = y + 300.0  # one batch of outliers (mislabelled data): its loss is ~10^4 times the others'
        out.append((x, y))
    return out


class Scenario:
    """A model, its data and how it trains; ``expect``: the cause (finding codes that must be present), advice that
    must come first or be present, and advice that would contradict the cause."""

    def __init__(self, name, build, data, loss, *, policy="dynamic", params=None, lr=1e-2, optimizer="adamw",
                 precision="fp16", cause=(), first=None, advised=(), never=(), verdict=None, headline=None,
                 weights_beyond=False, needs=None):
        self.name, self.build, self.data, self.loss, self.needs = name, build, data, loss, needs
        self.policy, self.params, self.lr, self.optimizer = policy, params or {}, lr, optimizer
        self.precision = precision
        self.cause, self.first, self.advised, self.never, self.verdict = cause, first, advised, never, verdict
        self.headline, self.weights_beyond = headline, weights_beyond

    @property
    def ends_worse(self) -> bool:
        """The planted outcome: a failure (no declared verdict: diagnose must not call it healthy) ends worse than
        the loop would in FP32, or diverges; a scenario declared healthy does not."""
        return self.verdict != "healthy"

    def optim(self, params):
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr)


def ce(out, y):
    return F.cross_entropy(out, y)


def mse(out, y):
    return F.mse_loss(out, y)


def divided(factor):
    def loss(out, y):  # a loss divided as a large gradient accumulation divides it
        return F.cross_entropy(out, y) / factor
    return loss


def big_fc2():
    torch.manual_seed(0)
    m = MLP(norm=True)
    with torch.no_grad():
        m.fc2.weight.mul_(2e5)  # weights within FP16's range, outputs (~10^5) beyond it: FP32 holds them
    return m


def inf_weight(model):
    """A weight beyond FP16's range: -10^5 in FP32, -inf once autocast (or .half()) casts it. Its output unit is
    -inf for every positive input (sigmoid before it), ReLU makes that 0: the loss stays finite, but the backward
    multiplies the zero gradient by -inf: NaN at every loss scale."""
    with torch.no_grad():
        model.fc2.weight[0, 0] = -1e5
    return model


def overflowing_backward():
    torch.manual_seed(0)
    return inf_weight(MLP(act=torch.sigmoid))


def lora_over_fp16_base():
    import peft  # an optional dependency: the scenario says so (``needs``) and its callers skip it without
    torch.manual_seed(0)
    base = inf_weight(MLP(act=torch.sigmoid)).half()  # a frozen FP16 base whose weight the cast overflowed
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1"]))
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    return model


def plain(seed=0):
    def build():
        torch.manual_seed(seed)
        return MLP()
    return build


SCENARIOS = [
    Scenario("forward_overflow", big_fc2, classes, ce, cause=("forward_overflow", "loss_nonfinite"),
             first="keep_fp32", headline="the model, not the loss scale: the forward pass left FP16's range first "
             "at fc2 (Linear)", never=("lower_init_scale", "lower_scale", "raise_scale", "replay_policy")),
    Scenario("backward_overflow_every_scale", overflowing_backward, classes, ce,
             cause=("overflow_every_scale", "overflow_at_low_scale"), advised=("bf16",), weights_beyond=True,
             headline="the model, not the loss scale",
             never=("lower_init_scale", "lower_scale", "raise_scale", "replay_policy")),
    Scenario("underflow_at_scale_1", plain(), classes, divided(2.0 ** 22), policy="none",
             cause=("fp16_underflow",), advised=("raise_scale",),
             never=("healthy", "lower_init_scale", "lower_scale", "bf16")),
    Scenario("underflow_hidden_by_a_small_static_scale", plain(), classes, ce, policy="static",
             params={"scale": 2.0 ** -18}, cause=("fp16_underflow",), advised=("raise_scale",),
             never=("healthy", "lower_init_scale", "lower_scale")),
    Scenario("lr_too_high", plain(), regression, mse, optimizer="sgd", lr=5.0,  # the weights grow past 65504
             cause=("loss_nonfinite",), first="lower_lr", headline="the training diverged", weights_beyond=True,
             never=("bf16", "keep_fp32", "fp32_fallback", "raise_scale", "lower_init_scale", "lower_scale",
                    "replay_policy")),
    Scenario("lr_too_high_fp32", plain(), regression, mse, optimizer="sgd", lr=5.0, precision="fp32",
             cause=("loss_nonfinite",), first="lower_lr",
             never=("bf16", "keep_fp32", "raise_scale", "lower_init_scale", "lower_scale")),
    Scenario("mid_run_loss_spike", plain(), lambda: regression(spike_at=25), mse, params={"init_scale": 2.0 ** 10},
             cause=("loss_spike",), first="healthy", verdict="healthy",
             never=("bf16", "keep_fp32", "lower_lr", "lower_init_scale")),
    Scenario("stuck_adapters", lora_over_fp16_base, classes, ce, needs="peft",
             cause=("adapters_not_training", "overflow_every_scale"), advised=("bf16",), weights_beyond=True,
             never=("lower_init_scale", "lower_scale", "raise_scale", "replay_policy")),
    Scenario("healthy", plain(), classes, ce, cause=(), first="healthy", verdict="healthy",
             never=("bf16", "keep_fp32", "lower_lr", "raise_scale", "lower_init_scale")),
]


def record_loop(s: Scenario, out, with_replay=True, torch_scaler=False) -> Path:
    """The loop a user writes, recorded into ``out``: lab.record(model, scaler, out=, optimizer=, replay=); with
    ``torch_scaler`` under torch.amp.GradScaler (docs/record.md's example) instead of the lab's policy."""
    model = s.build()
    data = s.data()
    opt = s.optim([p for p in model.parameters() if p.requires_grad])
    fp16 = s.precision == "fp16"
    scaler = lab.scaling.create(s.policy, device="cpu", **s.params) if fp16 else None
    if torch_scaler:
        scaler = torch.amp.GradScaler("cpu", **s.params)
    now = {}

    def replay():  # this step's forward and scaled backward again, on the same batch
        x, y = now["batch"]
        with lab.autocast("cpu", torch.float16):
            loss = s.loss(model(x), y)
        scaler.scale(loss).backward()

    with lab.record(model, scaler, out=out, optimizer=opt, replay=replay if fp16 and with_replay else None,
                    census_every=5,
                    log_every=10, name=s.name) as rec:
        for x, y in data:
            now["batch"] = (x, y)
            with lab.autocast("cpu", s.precision):  # "fp32": autocast off
                loss = s.loss(model(x), y)
            if fp16:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
    return Path(out)


def record_catalogue(out) -> list[Path]:
    """Every FP16 scenario's loop recorded under ``out``/<scenario> (a folder with metrics.json is kept: recorded
    already); scenarios whose optional dependency is missing (``needs``) are left out. The recordings, in order."""
    import importlib.util
    done = []
    for s in SCENARIOS:
        if s.precision != "fp16" or (s.needs and importlib.util.find_spec(s.needs) is None):
            continue
        folder = Path(out) / s.name
        if not (folder / "metrics.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a recording cut short: recorded again, whole
            record_loop(s, folder)
        done.append(folder)
    return done


def scenario(name: str) -> Scenario | None:
    """The scenario a recording's model name (lab.record's ``name``) is, or None."""
    return next((s for s in SCENARIOS if s.name == name), None)

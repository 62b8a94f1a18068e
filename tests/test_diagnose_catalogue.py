"""The catalogue of FP16 failures with known causes (docs/diagnose.md, "The catalogue"): each a real training loop
written as a user writes one, recorded with ``lab.record`` (plain PyTorch) and through accelerate's adapter
(``use_lab_scaler(..., out=, replay=)``), FP16 on the CPU under the tensor-core contract. ``lab diagnose`` must name
the cause and give no advice that its own evidence contradicts (lab/diagnose/advice.py's rules).

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
"""

import json

import pytest
import torch
import torch.nn.functional as F

import lab
import lab.scaling
from conftest import assert_valid_diagnosis
from lab.diagnose import diagnose, format_text

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
                 weights_beyond=False):
        self.name, self.build, self.data, self.loss = name, build, data, loss
        self.policy, self.params, self.lr, self.optimizer = policy, params or {}, lr, optimizer
        self.precision = precision
        self.cause, self.first, self.advised, self.never, self.verdict = cause, first, advised, never, verdict
        self.headline, self.weights_beyond = headline, weights_beyond

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
    peft = pytest.importorskip("peft")
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
    Scenario("stuck_adapters", lora_over_fp16_base, classes, ce,
             cause=("adapters_not_training", "overflow_every_scale"), advised=("bf16",), weights_beyond=True,
             never=("lower_init_scale", "lower_scale", "raise_scale", "replay_policy")),
    Scenario("healthy", plain(), classes, ce, cause=(), first="healthy", verdict="healthy",
             never=("bf16", "keep_fp32", "lower_lr", "raise_scale", "lower_init_scale")),
]


def train_plain(s: Scenario, out, with_replay=True, torch_scaler=False):
    """The loop a user writes, recorded: lab.record(model, scaler, out=, optimizer=, replay=); with ``torch_scaler``
    under torch.amp.GradScaler (docs/record.md's example) instead of the lab's policy."""
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
    return diagnose(out)


def train_accelerate(s: Scenario, out):
    """The same loop through accelerate, recorded by the lab's adapter (use_lab_scaler(..., out=, replay=))."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from lab.integrations.hf import close_recording, use_lab_scaler
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    now = {}

    def replay():
        x, y = now["batch"]
        scaler.scale(s.loss(model(x), y)).backward()  # the prepared model runs under accelerate's autocast

    scaler = use_lab_scaler(acc, s.policy, out=out, replay=replay, census_every=5, log_every=10, name=s.name,
                            **s.params)
    model = s.build()
    model, opt = acc.prepare(model, s.optim([p for p in model.parameters() if p.requires_grad]))
    try:
        for x, y in s.data():
            now["batch"] = (x, y)
            loss = s.loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        close_recording(acc)
        AcceleratorState._reset_state(True)
    return diagnose(out)


def check(s: Scenario, d):
    assert_valid_diagnosis(d)  # every scenario's --json holds to the documented schema
    text = format_text(d)
    found = [f.code for f in d.findings]
    recs = [r.code for r in d.recommendations]
    for code in s.cause:
        assert code in found, f"{s.name}: cause {code} not found\n{text}"
    if s.first:
        assert recs and recs[0] == s.first, f"{s.name}: first advice {recs[:1]}, expected {s.first}\n{text}"
    for code in s.advised:
        assert code in recs, f"{s.name}: {code} not advised\n{text}"
    for code in s.never:
        assert code not in recs, f"{s.name}: {code} contradicts the cause\n{text}"
    if s.headline:
        assert s.headline in d.headline, text
    if d.forward_overflow:  # the module's own weights beyond FP16's range: said, and the advice is about them
        assert d.forward_overflow["weights_beyond_fp16"] == s.weights_beyond, text
        keep = next((r for r in d.recommendations if r.code == "keep_fp32"), None)
        assert keep is None or keep.action.startswith("Hold") == s.weights_beyond, text
    if s.verdict:
        assert d.verdict == s.verdict, text
    else:
        assert d.verdict != "healthy", text
    return text


@pytest.mark.parametrize("s", SCENARIOS, ids=lambda s: s.name)
def test_plain_pytorch_loop(s, tmp_path):
    check(s, train_plain(s, tmp_path / "rec"))


@pytest.mark.parametrize("s", [s for s in SCENARIOS if s.policy == "dynamic" and s.precision == "fp16"],
                         ids=lambda s: s.name)
def test_under_torch_gradscaler(s, tmp_path):
    check(s, train_plain(s, tmp_path / "rec", torch_scaler=True))


@pytest.mark.parametrize("s", [s for s in SCENARIOS if s.precision == "fp16"], ids=lambda s: s.name)
def test_through_accelerate(s, tmp_path):
    check(s, train_accelerate(s, tmp_path / "rec"))


def test_the_fp32_replay_switches_autocast_off_inside_the_users_closure_and_back():
    """A recorded loop's replay holds its own autocast (accelerate wraps forward in one autocast object, kept for
    the whole run): under autocast_off it computes in FP32, and the same object computes in FP16 again after."""
    from lab.numerics.precision import autocast_off
    layer = torch.nn.Linear(4, 4)
    wrapped = torch.autocast("cpu", dtype=torch.float16)(layer.forward)
    x = torch.randn(2, 4)
    assert wrapped(x).dtype == torch.float16
    with autocast_off():
        assert wrapped(x).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.float32
    assert wrapped(x).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_underflow_without_a_replay_is_flagged_not_called_healthy(tmp_path):
    """Issue 38's first case as it was met: policy none, the loss divided by 2^22, recorded without replay=. The
    recorder cannot tell flushed values from true zeros, so the underflow is unknown, not 0%; every activation
    gradient being exactly zero is flagged, with how to measure it."""
    s = next(s for s in SCENARIOS if s.name == "underflow_at_scale_1")
    d = train_plain(s, tmp_path / "rec", with_replay=False)
    text = format_text(d)
    assert d.verdict == "issues" and d.underflow_at_final_scale is None, text
    f = next(f for f in d.findings if f.code == "grads_flushed")
    assert f.severity == "problem" and f.evidence["zero_share"]["activation_grad"] == 1.0, text
    recs = [r.code for r in d.recommendations]
    assert recs[:2] == ["raise_scale", "measure_underflow"] and "pass replay= to lab.record" in text
    assert "underflow         0.0%" not in text and "Nothing to change" not in text


class ResidualSum(torch.nn.Module):
    """fc's output fits FP16 (~4x10^4); the residual sum written as an operation, not a module, does not."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.fc.weight.fill_(0.0)
            self.fc.bias.fill_(40000.0)

    def forward(self, x):
        h = self.fc(x)
        return self.head(self.norm(h + h))


def test_a_value_past_fp16_outside_any_module_is_traced_to_what_feeds_the_fp32_module(tmp_path):
    """The first module whose output left FP16's range is LayerNorm, which autocast already runs in FP32: keeping it
    in FP32 would change nothing, so the advice names the computation that feeds it."""
    s = Scenario("residual_sum", ResidualSum, classes, ce)
    d = train_plain(s, tmp_path / "rec")
    assert d.forward_overflow["module"] == "norm" and d.forward_overflow["type"] == "LayerNorm", format_text(d)
    rec = next(r for r in d.recommendations if r.code == "keep_fp32")
    assert "feeds norm in FP32 (autocast already runs LayerNorm in FP32)" in rec.action
    assert "Keep norm (LayerNorm) in FP32" not in format_text(d)


@pytest.mark.parametrize("torch_scaler", [False, True])
def test_a_forward_overflow_is_located_without_a_replay(tmp_path, torch_scaler):
    """No replay= in the loop: the step after an overflow step has its forward probed, and the first module beyond
    FP16's range is named in the finding and in the advice, as a replay names it (lab/numerics/forward_range.py)."""
    s = next(s for s in SCENARIOS if s.name == "forward_overflow")
    d = train_plain(s, tmp_path / "rec", with_replay=False, torch_scaler=torch_scaler)
    check(s, d)
    text = format_text(d)
    assert d.forward_overflow["module"] == "fc2" and d.forward_overflow["type"] == "Linear", text
    keep = next(r for r in d.recommendations if r.code == "keep_fp32")
    assert "Keep fc2 (Linear) in FP32" in keep.action, text
    with open(tmp_path / "rec" / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["attribution_replays"] == 0 and 1 <= metrics["forward_probes"] <= 32

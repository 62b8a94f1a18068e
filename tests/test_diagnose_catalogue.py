"""The catalogue of FP16 failures with known causes (docs/diagnose.md, "The catalogue"): each a real training loop
written as a user writes one, recorded with ``lab.record`` (plain PyTorch) and through accelerate's adapter
(``use_lab_scaler(..., out=, replay=)``), FP16 on the CPU under the tensor-core contract. ``lab diagnose`` must name
the cause and give no advice that its own evidence contradicts (lab/diagnose/advice.py's rules). The scenarios and
their loops are lab/diagnose/catalogue.py's (the alert-threshold study records them too: lab/study/alerts.py).

"""

import json

import pytest
import torch

from conftest import assert_valid_diagnosis
from lab.diagnose import diagnose, format_text
# the scenarios and their loops, each taken from a real report (the module's docstring names them)
from lab.diagnose.catalogue import SCENARIOS, Scenario, ce, classes, record_loop


def train_plain(s: Scenario, out, with_replay=True, torch_scaler=False):
    """The scenario's loop recorded (lab/diagnose/catalogue.py: lab.record around it), then diagnosed."""
    if s.needs:
        pytest.importorskip(s.needs)
    return diagnose(record_loop(s, out, with_replay=with_replay, torch_scaler=torch_scaler))


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
    """The case as first found: policy none, the loss divided by 2^22, recorded without replay=. The
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

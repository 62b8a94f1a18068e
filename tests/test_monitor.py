"""lab.numerics.monitor: the gradient census and overflow attribution in a training loop."""
import csv
import functools
import math

import pytest
import torch
import torch.nn as nn

from lab.core.config import TRAIN_DEFAULTS, ConfigError, resolve_run, validate_study
from lab.numerics.census import CENSUS_COLUMNS, HIST_COLUMNS, Census, census, log2_histogram
from lab.numerics.monitor import ACTIVATION, PARAM, REPLAY_LIMIT, NumericsMonitor
from lab.run.train import STEP_FIELDS, train

from conftest import SyncCounter, tiny_study

SCALES = (1.0, 128.0, 1024.0, 65536.0)
CLASSES = ("zero", "underflow", "subnormal", "normal", "overflow")


# --- the monitor --------------------------------------------------------------------------------------------
def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Identity(),                                # acts on the input: no gradient flows there
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Identity(),                                # passes the very same tensor on
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(0.0), nn.Linear(16, 3))


def leaves_with_grad_outputs(model, x):
    """Leaf modules whose output takes part in backward, found with plain forward hooks."""
    names = set()
    handles = [m.register_forward_hook(lambda m, a, out, n=n: names.add(n) if out.requires_grad else None)
               for n, m in model.named_modules() if not list(m.children())]
    model(x)
    for h in handles:
        h.remove()
    return names


def census_step(model, x, y, monitor, step=0, precision="fp32", scale=1.0):
    monitor.begin_step(step, scale, precision)
    loss = nn.functional.cross_entropy(model(x), y) * scale
    loss.backward()
    monitor.after_backward()


def rows_by_layer(monitor, source, at_scale=1.0):
    return {r["layer"]: Census(*(r[k] for k in ("total", *CLASSES))) for r in monitor.census_rows
            if r["source"] == source and r["at_scale"] == at_scale}


def test_hooks_capture_every_leaf_module_and_match_tensor_hooks(device):
    model = small_model().to(device)
    x, y = torch.randn(8, 1, 6, 6, device=device), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], device=device)
    expected = leaves_with_grad_outputs(model, x)
    assert expected == {str(i) for i in range(1, 11)}  # all but the input Identity

    # independent capture: output.register_hook on every leaf's outputs
    grads = {}

    def capture(name, module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: grads.setdefault(name, []).append(g.clone()))
    handles = [m.register_forward_hook(functools.partial(capture, n))
               for n, m in model.named_modules() if not list(m.children())]
    monitor = NumericsMonitor(model, every=1)
    census_step(model, x, y, monitor)
    assert monitor.end_step(found_inf=False) == ""
    for h in handles:
        h.remove()

    act = rows_by_layer(monitor, "activation_grad")
    assert set(act) - {"__total__"} == expected == set(grads)
    for scale in SCALES:
        rows = rows_by_layer(monitor, "activation_grad", scale)
        for name, gs in grads.items():
            assert rows[name] == census(gs, scale=scale), (name, scale)
    # the Identity after the in-place ReLU and Dropout(0) pass the same tensor on: their rows repeat its
    # counts, and the total counts it once
    assert act["4"] == act["3"] and act["3"] != act["2"] and act["9"] == act["8"]
    distinct = [g for n, gs in grads.items() if n not in ("4", "9") for g in gs]
    assert act["__total__"] == census(distinct)
    par = rows_by_layer(monitor, "param_grad")
    assert set(par) == {"1", "2", "5", "10", "__total__"}
    assert par["10"] == census([p.grad for p in model[10].parameters()])
    assert par["__total__"] == census([p.grad for p in model.parameters()])
    # histogram rows: totals per source, every bin plus zero and nonfinite
    hist = monitor.hist_rows
    act_hist = {r["log2_bin"]: r["count"] for r in hist if r["source"] == "activation_grad"}
    assert len(act_hist) == 62 and sum(act_hist.values()) == act["__total__"].total
    assert act_hist == log2_histogram(distinct).as_dict()


def test_timm_resnet_in_place_activations():
    from lab.models.presets import create_model
    model = create_model("resnet50-digits", num_classes=10, in_chans=1, input_size=16)
    for m in model.modules():  # timm zero-initialises each block's last BN: let gradients through
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
    x, y = torch.randn(4, 1, 16, 16), torch.arange(4)
    expected = leaves_with_grad_outputs(model, x)
    monitor = NumericsMonitor(model, every=1)
    census_step(model, x, y, monitor)
    monitor.end_step(False)
    act = rows_by_layer(monitor, "activation_grad")
    assert set(act) - {"__total__"} == expected and "layer1.0.act1" in expected
    assert act["layer1.0.act1"] != act["layer1.0.bn1"]  # grad after the in-place ReLU vs before it
    assert act["fc"].total == 4 * 10


def test_monitor_syncs_once_per_census_step_and_hooks_only_then(monkeypatch):
    model = small_model()
    x, y = torch.randn(8, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    monitor = NumericsMonitor(model, every=2, attribute=True)
    census_step(model, x, y, monitor, step=0)
    monitor.end_step(False)  # warm: thresholds cached
    model.zero_grad()
    counter = SyncCounter(monkeypatch)
    census_step(model, x, y, monitor, step=2)
    assert counter.calls == []
    monitor.end_step(False)
    assert counter.calls == ["tolist"]
    counter.calls.clear()
    monitor.begin_step(3, 1.0, "fp32")  # not a census step: no hooks at all
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    nn.functional.cross_entropy(model(x), y).backward()
    monitor.after_backward()
    assert monitor.end_step(False) == "" and counter.calls == []
    assert monitor.census_steps == 2 and {r["step"] for r in monitor.census_rows} == {0, 2}


class InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


class Planted(nn.Module):
    """A linear layer whose backward can be made to produce inf."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)
        self.armed = False

    def forward(self, x):
        y = x @ self.weight.t()
        return InfGrad.apply(y) if self.armed else y


def planted_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), Planted(8), nn.GELU(), Planted(8), nn.LayerNorm(8),
                         nn.Linear(8, 3))


@pytest.mark.parametrize("where", [2, 4])
def test_overflow_attribution_from_parameter_gradients_names_the_planted_layer(where, device):
    """Without a replay (replay_limit=0): the parameter gradients as backward left them, flagged before
    unscale_ and clipping; clipping with an infinite norm makes every gradient NaN and must not matter."""
    model = planted_model().to(device)
    params = list(model.parameters())
    x, y = torch.randn(5, 6, device=device), torch.tensor([0, 1, 2, 0, 1], device=device)
    scaler = numerics_scaler(device.type)
    monitor = NumericsMonitor(model, every=10, attribute=True, replay_limit=0)
    opt = torch.optim.SGD(params, lr=0.0)
    first = []
    for step in range(3):  # step 0 is a clean census step (it records the backward order)
        model[where].armed = step >= 1
        monitor.begin_step(step, scaler.get_scale(), "fp16")
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        monitor.after_backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(params, 1.0)
        if step >= 1:
            assert all(not torch.isfinite(p.grad).any() for p in params)
        scaler.step(opt)
        scaler.update()
        first.append(monitor.end_step(scaler.last_found_inf))
        opt.zero_grad(set_to_none=True)
    assert first == ["", str(where), str(where)]
    assert monitor.finish()["first_overflow_step"] == 1 and monitor.first_nonfinite_layer == str(where)


def test_overflow_attribution_at_the_head_and_without_a_census_yet():
    model = planted_model()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    monitor = NumericsMonitor(model, every=1, attribute=True, replay_limit=0)
    monitor.begin_step(0, 2.0 ** 200, "fp32")
    (nn.functional.cross_entropy(model(x), y) * 2.0 ** 200).backward()  # inf gradient from the loss down
    monitor.after_backward()
    assert monitor.end_step(found_inf=True) == "6"
    fresh = NumericsMonitor(model, every=1000, attribute=True, replay_limit=0)  # no backward order yet
    fresh.begin_step(1, 1.0, "fp32")
    fresh.after_backward()
    assert fresh.end_step(found_inf=True) == "6"  # reverse definition order
    assert NumericsMonitor(model, every=1, attribute=True).end_step(found_inf=True) == ""  # nothing flagged


class InfAct(nn.Module):
    """A parameter-free module whose backward can be made to produce inf (as a softmax or a GELU can)."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return InfGrad.apply(x) if self.armed else x


def loop_step(model, monitor, scaler, opt, x, y, step, replay=True):
    """One optimizer step as lab.run.train runs it, with the replay it passes on skipped overflow steps."""
    from lab.run.loop import replay_step
    scale = scaler.get_scale()
    monitor.begin_step(step, scale, "fp32")
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    monitor.after_backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    again = None
    if replay and scaler.last_found_inf and scaler.last_step_skipped:
        again = functools.partial(replay_step, model, nn.functional.cross_entropy, [(x, y)], scale, "fp32",
                                  x.device.type, 1)
    layer = monitor.end_step(scaler.last_found_inf, again)
    opt.zero_grad(set_to_none=True)
    return layer, monitor.last_source


def test_replay_names_a_parameter_free_module_and_the_gradient_kind(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), InfAct(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    model = model.to(device)
    x, y = torch.randn(5, 6, device=device), torch.tensor([0, 1, 2, 0, 1], device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for replay in (True, False):
        scaler = numerics_scaler(device.type)
        monitor = NumericsMonitor(model, every=10, attribute=True, replay_limit=32 if replay else 0)
        assert loop_step(model, monitor, scaler, opt, x, y, 0, replay) == ("", "")  # records backward order
        model[2].armed = True
        got.append(loop_step(model, monitor, scaler, opt, x, y, 1, replay))
        model[2].armed = False
        assert monitor.finish()["attribution_replays"] == int(replay)
    # the replay sees the gradient at the ReLU's output turn inf (made by InfAct's backward, which consumes
    # it); the parameter gradients alone can only name the nearest module with parameters
    assert got == [("1", ACTIVATION), ("0", PARAM)]


def test_replay_names_a_parameter_gradient_when_it_is_the_first(device):
    model = planted_model().to(device)  # Planted's backward makes its own weight gradient inf first
    x, y = torch.randn(5, 6, device=device), torch.tensor([0, 1, 2, 0, 1], device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = numerics_scaler(device.type)
    monitor = NumericsMonitor(model, every=10, attribute=True)
    model[4].armed = True
    assert loop_step(model, monitor, scaler, opt, x, y, 0) == ("4", PARAM)


def test_a_replay_out_of_memory_ends_the_replays_not_the_run(caplog):
    model = planted_model()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = numerics_scaler()
    monitor = NumericsMonitor(model, every=10, attribute=True)
    loop_step(model, monitor, scaler, opt, x, y, 0)
    model[4].armed = True

    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")
    monitor.begin_step(1, scaler.get_scale(), "fp32")
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    monitor.after_backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    with caplog.at_level("WARNING", logger="lab.numerics.monitor"):
        assert monitor.end_step(True, no_memory) == ""
    assert "ran out of memory" in caplog.text and monitor.replay_limit == monitor.replays == 1
    opt.zero_grad(set_to_none=True)
    assert loop_step(model, monitor, scaler, opt, x, y, 2) == ("4", PARAM)  # flags from then on


def test_replay_leaves_the_run_unchanged_and_repeats_the_step_exactly(device):
    """BatchNorm statistics, dropout masks, gradients and generator states: training with replays on the
    overflow steps ends bit-identical to training without; the replayed forward equals the original."""
    def trained(replay_limit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), InfAct(),
                              nn.Linear(16, 3)).to(device)
        outputs = []
        model[5].register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
        x, y = torch.randn(32, 6, device=device), torch.randint(0, 3, (32,), device=device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = numerics_scaler(device.type)
        monitor = NumericsMonitor(model, every=2, attribute=True, replay_limit=replay_limit)
        names = []
        for step in range(6):
            model[4].armed = step in (1, 3)
            names.append(loop_step(model, monitor, scaler, opt, x, y, step))
        assert monitor.finish()["attribution_replays"] == min(replay_limit, 2)
        return model, outputs, names, torch.get_rng_state()

    model, outputs, names, rng = trained(32)
    plain, plain_outputs, plain_names, plain_rng = trained(0)
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(rng, plain_rng)
    # one extra forward per replayed step, equal to the step's own (same dropout mask, same BN batch stats)
    assert len(outputs) == len(plain_outputs) + 2
    assert torch.equal(outputs[1], outputs[2]) and torch.equal(outputs[4], outputs[5])
    assert not torch.equal(outputs[0], outputs[1])  # not trivially: the masks differ from step to step
    assert [n for n, _ in names] == ["", "3", "", "3", "", ""]  # the dropout's output gradient
    assert [n for n, _ in plain_names] == ["", "1", "", "1", "", ""]  # the BatchNorm's parameters


def numerics_scaler(device="cpu"):
    from lab import scaling
    return scaling.create("static", scale=1024.0, device=device)


# --- in the training loop -----------------------------------------------------------------------------------
def run(tmp_path, mode, mode_def=None, model="resnet50", device="cpu", **train_overrides):
    study = tiny_study(device=device)
    if mode_def:
        study["modes"][mode] = mode_def
    study["train"].update(train_overrides)
    cfg = resolve_run(validate_study(study), model, mode, 0)
    out = tmp_path / f"{model}-{mode}"
    return train(cfg, out), out


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def check_census_files(out, steps, at_scales, scale, grads="fp32"):
    """The rows of one kind of values (grads: the run's own, or "fp32" for an FP16 run's FP32 replay)."""
    rows = read_csv(out / "census.csv")
    assert list(rows[0]) == CENSUS_COLUMNS
    rows = [r for r in rows if r["grads"] == grads]
    assert {int(r["step"]) for r in rows} == steps
    assert {r["source"] for r in rows} == {"activation_grad", "param_grad"}
    assert {float(r["at_scale"]) for r in rows} == at_scales and {float(r["scale"]) for r in rows} == {scale}
    for r in rows:
        assert int(r["total"]) == sum(int(r[k]) for k in CLASSES)
    totals = {(r["step"], r["source"], float(r["at_scale"])): int(r["total"]) for r in rows
              if r["layer"] == "__total__"}
    assert len(totals) == len(steps) * 2 * len(at_scales)
    hist = read_csv(out / "grad_hist.csv")
    assert list(hist[0]) == HIST_COLUMNS
    hist = [h for h in hist if h["grads"] == grads]
    for (step, source, _), total in totals.items():
        counts = [int(h["count"]) for h in hist if h["step"] == step and h["source"] == source]
        assert len(counts) == 62 and sum(counts) == total
    return rows


def test_training_run_writes_census_files_fp32_and_fp16(tmp_path):
    metrics, out = run(tmp_path, "fp32", census_every=2)
    rows = check_census_files(out, {0, 2}, set(SCALES), 1.0)
    assert metrics["census_every"] == 2 and metrics["census_steps"] == 2
    assert metrics["first_overflow_step"] is None and metrics["first_nonfinite_layer"] is None
    layers = {r["layer"] for r in rows}
    assert {"conv1", "fc", "layer1.0.act1", "__total__"} <= layers
    # counterfactual: the same gradients at a higher scale never underflow more
    t = {float(r["at_scale"]): int(r["underflow"]) for r in rows
         if r["layer"] == "__total__" and r["source"] == "activation_grad" and r["step"] == "0"}
    assert t[1.0] >= t[128.0] >= t[1024.0] >= t[65536.0]
    assert not list(out.glob("*.tmp"))

    metrics, out = run(tmp_path, "fp16-static128", census_every=1, model="vit")
    rows = check_census_files(out, {0, 1, 2}, {128.0}, 128.0, grads="fp16")
    assert all(r["underflow"] == "0" for r in rows if r["source"] == "activation_grad"
               and r["layer"] in ("blocks.0.attn.qkv", "head"))  # FP16 tensors: already rounded
    replay = check_census_files(out, {0, 1, 2}, {128.0}, 128.0, grads="fp32")  # the same steps in FP32
    assert [(r["step"], r["source"], r["layer"], r["total"]) for r in replay] == \
        [(r["step"], r["source"], r["layer"], r["total"]) for r in rows]
    steps = read_csv(out / "steps.csv")
    assert list(steps[0]) == STEP_FIELDS and all(s["first_nonfinite_layer"] == "" for s in steps)


def test_training_run_overflow_attribution_and_census_off(tmp_path):
    huge = {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}}
    metrics, out = run(tmp_path, "fp16-huge", huge, census_every=5)
    assert metrics["first_overflow_step"] == 0 and metrics["first_nonfinite_layer"] == "fc"
    assert metrics["attribution_replays"] == 3
    steps = read_csv(out / "steps.csv")
    assert [(s["first_nonfinite_layer"], s["first_nonfinite_source"]) for s in steps] == [("fc", ACTIVATION)] * 3

    metrics, out = run(tmp_path, "fp16-static128", census_every=0)
    # census off: the files exist (a run's outputs never depend on its settings) but hold no rows
    assert (out / "census.csv").read_text().count("\n") == 1 and (out / "grad_hist.csv").read_text().count("\n") == 1
    assert metrics["census_steps"] == 0 and metrics["first_nonfinite_layer"] is None


def test_training_with_replays_equals_training_without(tmp_path):
    """The real loop (FP16 fast CPU path, BatchNorm, gradient accumulation over 2 micro-batches): a dynamic
    scale that starts far too high overflows on the first steps, which are replayed; every logged number and
    the final accuracy equal those of the same run with no replay (train.attribution_replays 0: parameter-gradient
    flags), and the setting is validated."""
    mode = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0 ** 40,
                                            "backoff_factor": 2.0 ** -10, "growth_interval": 1000}}
    replayed, out = run(tmp_path / "replay", "fp16-calibrating", mode, max_steps=6, accum_steps=2)
    flagged, plain = run(tmp_path / "flags", "fp16-calibrating", mode, max_steps=6, accum_steps=2,
                         attribution_replays=0)
    assert 0 < replayed["overflow_steps"] < replayed["steps"]  # some steps overflow, some do not
    assert replayed["attribution_replays"] == replayed["overflow_steps"] and flagged["attribution_replays"] == 0
    a, b = read_csv(out / "steps.csv"), read_csv(plain / "steps.csv")
    same = ["step", "loss", "scale", "found_inf", "skipped", "grad_norm", "lr"]
    assert [{k: r[k] for k in same} for r in a] == [{k: r[k] for k in same} for r in b]
    for key in ("final_top1", "final_train_loss", "final_scale", "skipped_steps"):
        assert replayed[key] == flagged[key], key
    assert {r["first_nonfinite_source"] for r in a if r["found_inf"] == "1"} <= {ACTIVATION, PARAM}
    assert {r["first_nonfinite_source"] for r in b if r["found_inf"] == "1"} == {PARAM}
    assert all(r["first_nonfinite_layer"] for r in a + b if r["found_inf"] == "1")
    assert TRAIN_DEFAULTS["attribution_replays"] == REPLAY_LIMIT  # the loop's default is the monitor's
    study = tiny_study()
    study["train"]["attribution_replays"] = -1
    with pytest.raises(ConfigError, match="attribution_replays"):
        validate_study(study)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_run_on_cuda_census_and_attribution(tmp_path):
    """CUDA autocast FP16: the census counts FP16 activation gradients, attribution names the head."""
    metrics, out = run(tmp_path, "fp16-static128", census_every=1, model="vit", device="cuda")
    assert metrics["device"] == "cuda" and metrics["fp16_path"] == "cuda-native"
    rows = check_census_files(out, {0, 1, 2}, {128.0}, 128.0)
    assert any(r["layer"] == "blocks.0.attn.qkv" for r in rows)
    huge = {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}}
    metrics, out = run(tmp_path, "fp16-huge", huge, census_every=5, device="cuda")
    assert metrics["first_overflow_step"] == 0 and metrics["first_nonfinite_layer"] == "fc"


def test_crash_leaves_no_census_file(tmp_path, monkeypatch):
    calls = []
    orig = NumericsMonitor.end_step

    def failing(self, found_inf, replay=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return orig(self, found_inf, replay)
    monkeypatch.setattr(NumericsMonitor, "end_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, "fp32", census_every=1)
    out = tmp_path / "resnet50-fp32"
    assert not (out / "census.csv").exists() and not (out / "grad_hist.csv").exists()


def test_census_every_is_validated():
    with pytest.raises(ValueError, match="census_every"):
        NumericsMonitor(nn.Linear(2, 2), -1)
    study = tiny_study()
    assert resolve_run(validate_study(study), "vit", "fp32", 0).train.census_every == 80  # docs/census.md's default
    study["train"]["census_every"] = -1
    with pytest.raises(ConfigError, match="census_every"):
        validate_study(study)


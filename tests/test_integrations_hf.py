"""accelerate and the transformers Trainer with the lab's scaler (lab/integrations/hf.py), against the real
packages: each trap the plain framework sets for FP16 on a CPU, and what the adapter does instead."""
import json

import pytest
import torch

pytest.importorskip("accelerate")  # requirements.txt installs both; a user's own env may not have them
pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import lab.scaling  # noqa: E402
from lab.diagnose import diagnose  # noqa: E402
from lab.diagnose.inspect import inspect_run  # noqa: E402
from lab.integrations.common import IntegrationError  # noqa: E402
from lab.integrations.hf import close_recording, use_lab_scaler, use_lab_trainer  # noqa: E402
from lab.numerics.contract import tensor_core_contract  # noqa: E402

HIGH = 2.0 ** 40  # the first steps overflow and are skipped


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state in a process-wide singleton: each test builds its own."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.seen = []

    def forward(self, x):
        out = self.net(x)
        self.seen.append((out.dtype, any(isinstance(m, tensor_core_contract)
                                         for m in torch.overrides._get_current_function_mode_stack())))
        return out


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def accelerate_train(acc, steps=12, fused=False):
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    net, opt = acc.prepare(net, opt)
    losses, skipped = [], []
    for x, y in batches(steps):
        loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(acc.optimizer_step_was_skipped)
    return acc.unwrap_model(net), losses, skipped


def test_trap_fp16_on_cpu_trains_fp32_silently():
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    assert acc.native_amp is False and acc.scaler is None
    net, _, _ = accelerate_train(acc, steps=2)
    assert {d for d, _ in net.seen} == {torch.float32}


def test_trap_scaler_set_after_prepare_breaks_training_and_the_adapter_refuses():
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    net = Net()
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    scaler = lab.scaling.create("dynamic", device="cpu")
    acc.native_amp, acc.scaler = True, scaler
    assert opt.scaler is None  # the optimizer kept what prepare() saw
    losses, skipped = [], []
    for x, y in batches(4):
        loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        acc.backward(loss)  # scaled by 2^16 ...
        opt.step()          # ... and applied unscaled, never skipped, the scale never updated
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(acc.optimizer_step_was_skipped)
    assert losses[0] < 2 and losses[1] > 1e3 * losses[0] and losses[3] > 1e3 * losses[1]  # gradients 2^16 too big
    assert skipped == [False] * 4 and scaler.get_scale() == 2.0 ** 16 and scaler.steps == 0
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.prepare(Net())
    with pytest.raises(IntegrationError, match="before accelerator.prepare"):
        use_lab_scaler(acc, "dynamic")


def reference_accelerator(grad_scaler):
    """accelerate's own path with torch.amp.GradScaler put in before prepare(), the forward under the contract."""
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.native_amp, acc.scaler = True, grad_scaler
    prepare_model = acc.prepare_model

    def prepare_model_(model, *a, **k):
        model = prepare_model(model, *a, **k)
        forward = model.forward

        def forward_(*args, **kwargs):
            with tensor_core_contract():
                return forward(*args, **kwargs)
        model.forward = forward_
        return model
    acc.prepare_model = prepare_model_
    return acc


@pytest.mark.parametrize("fused", [False, True])
def test_accelerate_adapter_equals_gradscaler_and_reports_skips_truthfully(tmp_path, fused):
    """Bit for bit GradScaler's training, FP16 under the contract; step_was_skipped from the scaler. With a fused
    AdamW accelerate's own guess says no step was ever skipped (the trap); the adapter says which were."""
    grad = torch.amp.GradScaler("cpu", init_scale=HIGH, growth_interval=3)
    ref, ref_losses, ref_skipped = accelerate_train(reference_accelerator(grad), fused=fused)
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = use_lab_scaler(acc, "dynamic", init_scale=HIGH, growth_interval=3, out=tmp_path / "rec")
    net, losses, skipped = accelerate_train(acc, fused=fused)
    metrics = close_recording(acc)
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)
    assert losses == ref_losses and scaler.get_scale() == grad.get_scale()
    assert {s for s in net.seen} == {(torch.float16, True)}
    truth = [r == "1" for r in (row["skipped"] for row in _rows(tmp_path / "rec"))]
    assert skipped == truth and sum(truth) == scaler.skipped_steps > 0
    assert ref_skipped == (truth if not fused else [False] * len(truth))  # the trap: fused hides every skip
    assert metrics["skipped_steps"] == scaler.skipped_steps and inspect_run(tmp_path / "rec")["finished"]


def test_accelerate_honours_the_fp32_fallback():
    """docs/integrations.md: after `fp32_fallback_after` skipped steps in a row the forward runs in FP32 (autocast
    off, no contract) and the steps apply again. A scale of 2^60 overflows every FP16 backward."""
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = use_lab_scaler(acc, "static", scale=2.0 ** 60, fp32_fallback_after=3)
    net, losses, skipped = accelerate_train(acc, steps=6)
    assert skipped == [True, True, True, False, False, False] and scaler.fallback_step == 2
    assert net.seen[:3] == [(torch.float16, True)] * 3 and {d for d, _ in net.seen[3:]} == {torch.float32}


def test_close_recording_with_the_error_writes_status_failed(tmp_path):
    """docs/integrations.md: a loop that raises, closed with close_recording(accelerator, error=e), leaves a
    metrics.json with status failed and the error, which lab inspect reads."""
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    use_lab_scaler(acc, "dynamic", init_scale=HIGH, out=tmp_path / "rec")
    try:
        accelerate_train(acc, fused=False, steps=3)
        raise RuntimeError("the data loader broke")
    except RuntimeError as e:
        metrics = close_recording(acc, error=e)
    assert metrics["status"] == "failed" and "the data loader broke" in json.dumps(metrics)
    on_disk = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert on_disk["status"] == "failed"


def _rows(run_dir):
    import csv
    with open(run_dir / "steps.csv", newline="") as f:
        return list(csv.DictReader(f))


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))


def lm_data(n=48):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def trainer(tmp_path, steps=12, **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, report_to=[],
                             disable_tqdm=True, **{"save_strategy": "no", **kw})
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=lm_data())


def test_trap_trainer_fp16_on_cpu_is_fp32_and_fused_adamw_hides_skips(tmp_path):
    t = trainer(tmp_path)
    assert t.accelerator.native_amp is False and t.accelerator.scaler is None  # fp16=True, no FP16 at all
    AcceleratorState._reset_state(True)
    t = trainer(tmp_path)
    grad = torch.amp.GradScaler("cpu", init_scale=HIGH)
    t.accelerator.native_amp, t.accelerator.scaler = True, grad  # GradScaler put in the way accelerate reads it
    t.train()
    assert "fused" in t.args.optim
    assert grad.get_scale() < HIGH  # GradScaler skipped a step at each halving on its way down ...
    assert t.lr_scheduler.last_epoch == t.state.global_step  # ... and the schedule advanced on every one of them


def test_trainer_adapter_trains_fp16_records_and_keeps_the_schedule(tmp_path, monkeypatch):
    import lab.integrations.common as common
    entered, real = [], common.tensor_core_contract

    def counting(*a, **k):  # the contract each forward runs under (dropping it leaves this empty)
        entered.append(1)
        return real(*a, **k)
    monkeypatch.setattr(common, "tensor_core_contract", counting)
    t = trainer(tmp_path)
    scaler = use_lab_trainer(t, "dynamic", init_scale=HIGH, out=tmp_path / "rec", name="gpt2-tiny")
    t.train()
    assert len(entered) >= t.state.global_step  # every training forward ran under the tensor-core contract
    assert t.args.optim in ("adamw_torch_fused", "adamw_torch")
    assert scaler.skipped_steps > 0
    assert t.lr_scheduler.last_epoch == t.state.global_step - scaler.skipped_steps  # skipped steps do not count
    logged = [h for h in t.state.log_history if "skipped_steps" in h]
    assert logged and logged[-1]["skipped_steps"] == scaler.skipped_steps
    d = diagnose(tmp_path / "rec")
    assert d.status == "ok" and d.steps == 12 and d.skipped_steps == scaler.skipped_steps
    assert inspect_run(tmp_path / "rec")["skipped"] == scaler.skipped_steps


def test_trainer_honours_the_fp32_fallback(tmp_path):
    """docs/integrations.md: the transformers Trainer too: a scale of 2^60 overflows every FP16 backward; after
    `fp32_fallback_after` (3) skips the forward runs in FP32 and the steps apply."""
    t = trainer(tmp_path, steps=6)
    seen = []
    t.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    scaler = use_lab_trainer(t, "static", scale=2.0 ** 60, fp32_fallback_after=3)
    t.train()
    assert scaler.fallback_step == 2 and scaler.skipped_steps == 3
    assert seen == [torch.float16] * 3 + [torch.float32] * 3


def test_accelerate_checkpoint_resumes_exactly(tmp_path):
    """save_state / load_state carry the lab scaler (scaler.pt, loadable with weights_only=True): 6 steps, a
    checkpoint, 6 more from it in a fresh accelerator equal 12 in one go, bit for bit."""
    kw = dict(init_scale=HIGH, growth_interval=3)
    data = batches(12)

    def run(acc, net, opt, part):
        for x, y in part:
            acc.backward(torch.nn.functional.cross_entropy(net(x).float(), y))
            opt.step()
            opt.zero_grad()

    def build():
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True, mixed_precision="fp16")
        scaler = use_lab_scaler(acc, "dynamic", **kw)
        net = Net()
        net, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return acc, scaler, net, opt

    acc, _, straight, opt = build()
    run(acc, straight, opt, data)
    acc, scaler, net, opt = build()
    run(acc, net, opt, data[:6])
    acc.save_state(tmp_path / "ckpt")
    state = torch.load(tmp_path / "ckpt" / "scaler.pt", weights_only=True)
    assert state["scale"] == scaler.get_scale()
    acc, resumed_scaler, resumed, opt = build()
    acc.load_state(tmp_path / "ckpt")
    assert resumed_scaler.get_scale() == scaler.get_scale() and resumed_scaler.steps == 6
    run(acc, resumed, opt, data[6:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_trainer_checkpoint_carries_the_scaler_and_resumes_exactly(tmp_path):
    """The Trainer saves the lab scaler as scaler.pt (weights_only-loadable) and restores it on resume: 12 steps
    in one go equal 6, a checkpoint, and 6 more resumed from it, bit for bit."""
    straight = trainer(tmp_path / "a")
    use_lab_trainer(straight, "dynamic", init_scale=HIGH, growth_interval=3)
    straight.train()
    AcceleratorState._reset_state(True)
    first = trainer(tmp_path / "b", save_strategy="steps", save_steps=6)
    scaler = use_lab_trainer(first, "dynamic", init_scale=HIGH, growth_interval=3)
    first.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-6"
    assert torch.load(ckpt / "scaler.pt", weights_only=True)["steps"] == 6
    AcceleratorState._reset_state(True)
    resumed = trainer(tmp_path / "c")
    again = use_lab_trainer(resumed, "dynamic", init_scale=HIGH, growth_interval=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert again.get_scale() == scaler.get_scale() and again.skipped_steps == scaler.skipped_steps > 0
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)

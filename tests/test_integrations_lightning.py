"""Lightning's Trainer and Fabric with the lab's plugins (lab/integrations/lightning.py), against the real
package: each trap the plain framework sets for FP16 on a CPU, and what the plugin does instead."""

import contextlib
import json

import pytest
import torch

lightning = pytest.importorskip("lightning")  # requirements.txt installs it; a user's own env may not have it
import lightning as L  # noqa: E402
from lightning.fabric.plugins.precision.amp import MixedPrecision as FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import lab.scaling  # noqa: E402
from lab.cli import main  # noqa: E402
from lab.diagnose import diagnose  # noqa: E402
from lab.integrations.common import IntegrationError  # noqa: E402
from lab.diagnose.inspect import inspect_run  # noqa: E402
from lab.integrations.lightning import LabFabricPrecision, LabPrecision  # noqa: E402
from lab.numerics.contract import tensor_core_contract  # noqa: E402

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
HIGH = 2.0 ** 40  # the first steps overflow and are skipped (FP16's largest value is 65504)


def contract_active() -> bool:
    return any(isinstance(m, tensor_core_contract) for m in torch.overrides._get_current_function_mode_stack())


class Net(L.LightningModule):
    """A small classifier that notes, per training step, its activations' dtype and whether the contract is on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.seen = []

    def training_step(self, batch, i):
        x, y = batch
        out = self.net(x)
        self.seen.append((out.dtype, contract_active()))
        return torch.nn.functional.cross_entropy(out.float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n=48):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def with_contract(autocast):
    """A framework's own autocast context, joined by the CPU contract (the references below)."""
    stack = contextlib.ExitStack()
    stack.enter_context(autocast)
    stack.enter_context(tensor_core_contract())
    return stack


class ContractGradScalerPrecision(MixedPrecision):
    """The reference: Lightning's own plugin with torch.amp.GradScaler, its autocast joined by the same contract."""

    def autocast_context_manager(self):
        return with_contract(super().autocast_context_manager())


def fit(plugin, epochs=2, **kw):
    model = Net()
    L.Trainer(accelerator="cpu", plugins=[plugin], max_epochs=epochs, **QUIET, **kw).fit(model, loader())
    return model


def test_trap_16_mixed_on_cpu_becomes_bf16():
    with pytest.warns(UserWarning, match="fp16 is not supported"):
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", **QUIET)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    with pytest.warns(UserWarning, match="fp16 is not supported"):
        fabric = L.Fabric(accelerator="cpu", precision="16-mixed")
    assert fabric._precision.precision == "bf16-mixed"


def test_trainer_plugin_equals_gradscaler_bit_for_bit_and_records(tmp_path):
    """The lab's `dynamic` in Lightning trains exactly as GradScaler does (skips included), FP16 under the
    contract, and the recording's skips are the scaler's."""
    grad = torch.amp.GradScaler("cpu", init_scale=HIGH, growth_interval=3)
    ref = fit(ContractGradScalerPrecision("16-mixed", "cpu", grad))
    plugin = LabPrecision("dynamic", init_scale=HIGH, growth_interval=3, out=tmp_path / "rec", name="net")
    model = fit(plugin)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert plugin.scaler.get_scale() == grad.get_scale()
    # every training forward in FP16 under the contract; the FP32 ones are the census's replays (built by the
    # plugin), which left the training above bit for bit as GradScaler's
    fp32 = sum(dtype == torch.float32 for dtype, _ in model.seen)
    with open(tmp_path / "rec" / "metrics.json") as f:
        assert fp32 == json.load(f)["census_fp32_replays"] > 0
    assert model.seen and all(s == (torch.float16, True) for s in model.seen if s[0] != torch.float32)
    assert plugin.skipped_steps > 0
    rows = inspect_run(tmp_path / "rec")
    assert rows["steps"] == 12 and rows["skipped"] == plugin.skipped_steps
    d = diagnose(tmp_path / "rec")
    assert d.status == "ok" and d.skipped_steps == plugin.skipped_steps and d.initial_overflow_streak > 0
    assert main(["replay", str(tmp_path / "rec"), "--policy", f"dynamic:init_scale={HIGH},growth_interval=3"]) == 0


def test_fp32_fallback_is_honoured(tmp_path):
    """A forward that overflows FP16 at any scale: after `fp32_fallback_after` skips autocast goes off, and the
    steps after it train (in FP32)."""
    model = Net()
    with torch.no_grad():
        model.net[0].weight.mul_(1e6)  # activations far past 65504 in FP16: inf at every scale
    plugin = LabPrecision("dynamic", init_scale=1.0, fp32_fallback_after=2, out=tmp_path / "rec", replay=False)
    L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=5, **QUIET).fit(model, loader())
    s = plugin.scaler
    assert s.fallback_step == 1 and s.skipped_steps == 2
    assert [d for d, _ in model.seen] == [torch.float16] * 2 + [torch.float32] * 3
    state = inspect_run(tmp_path / "rec")
    assert state["fp32_fallback_step"] == 2 and state["skipped"] == 2


def test_trap_lightning_own_plugin_ignores_the_fallback():
    """The same run with Lightning's own MixedPrecision holding the lab scaler: the fallback fires, autocast stays
    FP16, and every step overflows and is skipped."""
    model = Net()
    with torch.no_grad():
        model.net[0].weight.mul_(1e6)
    scaler = lab.scaling.create("dynamic", device="cpu", init_scale=1.0, fp32_fallback_after=2)
    L.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler)], max_steps=5,
              **QUIET).fit(model, loader())
    assert scaler.fallback_step == 1 and scaler.skipped_steps == 5
    assert [d for d, _ in model.seen] == [torch.float16] * 5


def test_trainer_checkpoint_resumes_exactly(tmp_path):
    """The scaler's state travels in Lightning's checkpoint: 1 epoch, a checkpoint, 1 more epoch resumed from
    it equals 2 epochs in one go, bit for bit."""
    kw = dict(init_scale=HIGH, growth_interval=3)
    straight = fit(LabPrecision("dynamic", **kw), epochs=2)
    first = Net()
    trainer = L.Trainer(accelerator="cpu", plugins=[LabPrecision("dynamic", **kw)], max_epochs=1, **QUIET)
    trainer.fit(first, loader())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    second, plugin = Net(), LabPrecision("dynamic", **kw)
    L.Trainer(accelerator="cpu", plugins=[plugin], max_epochs=2, **QUIET).fit(second, loader(),
                                                                              ckpt_path=tmp_path / "one.ckpt")
    for a, b in zip(straight.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert plugin.scaler.steps == 12


def test_no_contract_on_cpu_is_said_loudly():
    with pytest.warns(UserWarning, match="native CPU FP16 kernels"):
        LabPrecision("dynamic", device="cpu", contract=False)
    with pytest.warns(UserWarning, match="native CPU FP16 kernels"):  # the device taken from the module
        fit(LabPrecision("dynamic", contract=False), epochs=1)


def fabric_train(plugin, steps=10, clip=None, error_if_nonfinite=True):
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    for i, (x, y) in zip(range(steps), loader(8 * steps)):
        loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=error_if_nonfinite)
        opt.step()
        opt.zero_grad()
    fabric._strategy.teardown()
    return net


class ContractFabricPrecision(FabricMixedPrecision):
    def forward_context(self):
        return with_contract(super().forward_context())


def test_fabric_plugin_equals_gradscaler_and_records(tmp_path):
    grad = torch.amp.GradScaler("cpu", init_scale=HIGH, growth_interval=3)
    ref = fabric_train(ContractFabricPrecision("16-mixed", "cpu", grad))
    plugin = LabFabricPrecision("dynamic", init_scale=HIGH, growth_interval=3, out=tmp_path / "rec")
    net = fabric_train(plugin)
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)
    assert plugin.skipped_steps > 0
    assert inspect_run(tmp_path / "rec")["skipped"] == plugin.skipped_steps
    assert diagnose(tmp_path / "rec").steps == 10


def test_fabric_honours_the_fp32_fallback(tmp_path):
    """docs/integrations.md: in Fabric too, after `fp32_fallback_after` skips in a row the forward runs in FP32
    (autocast off) and the steps apply again. The first layer's weights put activations past 65504 at any scale."""
    fabric = L.Fabric(accelerator="cpu", plugins=[LabFabricPrecision("dynamic", init_scale=1.0,
                                                                     fp32_fallback_after=2, out=tmp_path / "rec")])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        net[0].weight.mul_(1e6)
    seen = []
    net[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-9))
    for x, y in zip(range(5), loader(40)):
        fabric.backward(torch.nn.functional.cross_entropy(net(y[0]).float(), y[1]))
        opt.step()
        opt.zero_grad()
    s = fabric._precision.scaler
    assert s.fallback_step == 1 and s.skipped_steps == 2
    assert seen == [torch.float16] * 2 + [torch.float32] * 3


def test_trap_fabric_clip_gradients_raises_on_overflow():
    """Fabric's default error_if_nonfinite=True ends an FP16 run at its first overflow step; with False, the lab
    scaler skips that step and training goes on."""
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric_train(LabFabricPrecision("dynamic", init_scale=HIGH), steps=3, clip=1.0)
    plugin = LabFabricPrecision("dynamic", init_scale=HIGH)
    fabric_train(plugin, steps=30, clip=1.0, error_if_nonfinite=False)
    assert 0 < plugin.skipped_steps < 30


def test_a_fit_that_raises_is_recorded_as_failed(tmp_path):
    class Breaks(Net):
        def training_step(self, batch, i):
            if i == 3:
                raise RuntimeError("data loader died")
            return super().training_step(batch, i)

    plugin = LabPrecision("dynamic", out=tmp_path / "rec")
    with pytest.raises(RuntimeError, match="data loader died"):
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=6, **QUIET).fit(Breaks(), loader())
    d = diagnose(tmp_path / "rec")
    assert d.status == "failed" and d.steps == 3
    assert "data loader died" in json.loads((tmp_path / "rec" / "metrics.json").read_text())["error"]


def test_the_plugins_take_the_modules_device_and_refuse_another(tmp_path):
    """With no device given, the plugin's is the module's once Lightning has moved it (here the CPU; on a
    GPU, cuda: tests/test_cuda.py); a device given that the module is not on is refused, in the Trainer and in
    Fabric, instead of autocast on the wrong device training in FP32 under an fp16 label."""
    plugin = LabPrecision("dynamic", init_scale=HIGH, growth_interval=3)
    model = fit(plugin, epochs=1)
    assert plugin.device == "cpu" and plugin.contract and model.seen[0] == (torch.float16, True)
    with pytest.warns(UserWarning):  # the scaler says CUDA is not available
        wrong = LabPrecision("dynamic", device="cuda")
    with pytest.raises(IntegrationError, match="module is on 'cpu'"):
        fit(wrong, epochs=1)
    with pytest.warns(UserWarning):
        wrong_fabric = LabFabricPrecision("dynamic", device="cuda")
    with pytest.raises(IntegrationError, match="module is on 'cpu'"):
        fabric_train(wrong_fabric)
    fabric_plugin = LabFabricPrecision("dynamic", init_scale=HIGH, growth_interval=3)
    fabric_train(fabric_plugin)
    assert fabric_plugin.device == "cpu" and fabric_plugin.contract

"""torchao float8 training (`convert_to_float8_training`, emulated on the CPU) in BF16 through each framework adapter:
a transformers Trainer, a Lightning Trainer (and Fabric) and an accelerate loop, each recorded
by the adapter's one line with no loss scaler (``policy=None``). The run's fp8_census.csv holds every converted linear's
input, weight and output gradient on the census steps and on no other step; `lab diagnose` calls the run healthy
with its FP8 section filled; `lab replay` quantizes the kept operands under every recipe."""
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import lab  # noqa: E402
from lab.diagnose import diagnose, format_text  # noqa: E402
from lab.fp8 import create_recipe  # noqa: E402
from lab.fp8.census import NUMBERS  # noqa: E402
from lab.fp8.linear import convert  # noqa: E402
from lab.fp8.model_census import Fp8Census  # noqa: E402
from lab.fp8.replay import replay_run  # noqa: E402
from lab.integrations.common import IntegrationError, torchao_autocast_input  # noqa: E402
from lab.integrations.hf import close_recording, use_lab_scaler, use_lab_trainer  # noqa: E402
from lab.integrations.lightning import LabFabricPrecision, LabPrecision  # noqa: E402
from lab.models.presets import create_model  # noqa: E402

V, T, BATCH = 64, 16, 8
STEPS, EVERY = 5, 2  # census steps 0, 2, 4
RECIPES = ["tensorwise", "rowwise"]
ROLES = {("forward", "input"), ("forward", "weight"), ("grad_input", "grad_output"), ("grad_input", "weight"),
         ("grad_weight", "grad_output"), ("grad_weight", "input")}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def to_float8(model, recipe):
    """torchao's recipe, emulated (no FP8 GEMM on a CPU), the LM head kept in high precision."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=type(config)(**{**config.__dict__, "emulate": True}),
                               module_filter_fn=lambda mod, name: "head" not in name)
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert names and not [n for n in names if "head" in n]
    return names


def tokens(n=STEPS * BATCH, seed=0):
    """A learnable chain: each token has 4 possible successors."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, V, (V, 4), generator=g)
    x = torch.zeros(n, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,), generator=g)
    for t in range(T):
        x[:, t + 1] = nxt[x[:, t], torch.randint(0, 4, (n,), generator=g)]
    return x


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T))


def check(out, layers, steps=STEPS):
    """The census on the census steps only, every layer's every operand; diagnosed healthy; replayed."""
    census = pd.read_csv(out / "fp8_census.csv")
    assert sorted(census.step.unique()) == list(range(0, steps, EVERY))
    for step, rows in census.groupby("step"):
        assert set(rows.layer) == set(layers), step
        for layer, own in rows.groupby("layer"):  # once each: an evaluation's forward on a census step is not counted
            assert set(zip(own.gemm, own.role)) == ROLES and len(own) == len(ROLES), (step, layer)
    assert (census.numel > 0).all() and (census.nonzero > 0).all()
    # each layer's input as a GPU's autocast gives it to torchao: in BF16, also after an RMSNorm or LayerNorm (which
    # autocast keeps in FP32; torchao casts its input under CUDA autocast only: the adapter casts it on the CPU)
    kept = torch.load(out / "fp8_operands.pt", weights_only=True)
    assert set(kept) == set(layers)
    for layer, ops in kept.items():
        assert ops["step"] == census.step.max() and torch.equal(ops["x"], ops["x"].bfloat16().float()), layer
    d = diagnose(out)
    text = format_text(d)
    assert d.verdict == "healthy", text
    assert d.fp8 is not None and d.fp8["census_steps"] == len(range(0, steps, EVERY)), text
    steps_csv = pd.read_csv(out / "steps.csv")
    assert len(steps_csv) == steps and set(steps_csv.precision) == {"bf16"}
    rows = {r["recipe"]: r for r in replay_run(out)}
    assert {"fp8-current", "fp8-rowwise", "fp8-delayed"} <= set(rows)
    return census, d


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_transformers_trainer(tmp_path, recipe):
    model = llama()
    layers = to_float8(model, recipe)
    data = [{"input_ids": x[:-1], "labels": x[:-1]} for x in tokens()]  # the model shifts its labels
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, bf16=True, max_steps=STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=3e-3, report_to=[], save_strategy="no",
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             eval_strategy="steps", eval_steps=EVERY, per_device_eval_batch_size=BATCH)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:BATCH])
    out = tmp_path / "rec"
    assert use_lab_trainer(trainer, None, out=out, census_every=EVERY, log_every=2) is None
    trainer.train()
    check(out, layers)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_accelerate_loop(tmp_path, recipe):
    model = llama()
    layers = to_float8(model, recipe)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    out = tmp_path / "rec"
    assert use_lab_scaler(acc, None, out=out, census_every=EVERY, log_every=2) is None
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    for x in tokens().split(BATCH):
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    close_recording(acc)
    check(out, layers)


class GPT(L.LightningModule):
    """The lab's gpt-tiny, converted in configure_model (where Lightning wants model conversions)."""

    def __init__(self, recipe):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)
        self.recipe, self.layers = recipe, None

    def configure_model(self):
        if self.layers is None:
            self.layers = to_float8(self.gpt, self.recipe)

    def training_step(self, batch, i):
        (x,) = batch
        logits = self.gpt(x[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, V), x[:, 1:].reshape(-1))

    def validation_step(self, batch, i):  # the sanity check before step 0, and after every other step
        return self.training_step(batch, i)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_lightning_trainer(tmp_path, recipe):
    model = GPT(recipe)
    out = tmp_path / "rec"
    plugin = LabPrecision(None, out=out, census_every=EVERY, log_every=2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens()), batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens(BATCH, seed=1)), batch_size=BATCH)
    L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=STEPS, val_check_interval=EVERY, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, loader, val)
    check(out, [f"gpt.{n}" for n in model.layers])


def test_a_lightning_fabric_loop(tmp_path):
    torch.manual_seed(0)
    gpt = create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)
    layers = to_float8(gpt, "rowwise")
    out = tmp_path / "rec"
    fabric = L.Fabric(accelerator="cpu", plugins=[LabFabricPrecision(None, out=out, census_every=EVERY, log_every=2)])
    model, opt = fabric.setup(gpt, torch.optim.AdamW(gpt.parameters(), lr=3e-3))
    for x in tokens().split(BATCH):
        loss = F.cross_entropy(model(x[:, :-1]).float().reshape(-1, V), x[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    fabric._strategy.teardown()  # the plugin's teardown: metrics.json
    check(out, layers)


def test_policy_none_is_for_bf16_only():
    """No loss scaler is a BF16 (or FP32) run; an FP16 one is refused without a policy, a BF16 one with one."""
    with pytest.raises(IntegrationError, match="FP16 needs a lab policy"):
        use_lab_scaler(Accelerator(cpu=True, mixed_precision="fp16"), None)
    AcceleratorState._reset_state(True)
    with pytest.raises(IntegrationError, match="pass policy=None"):
        use_lab_scaler(Accelerator(cpu=True, mixed_precision="bf16"), "dynamic")
    with pytest.raises(IntegrationError, match="policy=None"):
        LabPrecision(None, init_scale=2.0 ** 16)


@pytest.mark.parametrize("lab_name, recipe", [("fp8-current", "tensorwise"), ("fp8-rowwise", "rowwise")])
def test_torchao_under_cpu_autocast_is_given_what_a_gpu_gives_it(lab_name, recipe):
    """torchao's Float8Linear casts its input to the autocast dtype under CUDA autocast only; the lab's equal recipe
    layer casts it under any autocast, as a GPU's Float8Linear is given it. With the adapters' hook
    (torchao_autocast_input), three BF16 steps of torchao's layers under CPU autocast have the census of the lab's
    layers bit for bit, every operand of every step; without it the inputs reach the float8 cast in FP32 (after a
    LayerNorm) and most rows differ."""
    def run(model, hook):
        if hook:
            assert torchao_autocast_input(model, "cpu") == 8  # gpt-tiny's linears, its head left out
        census, g = Fp8Census(model, every=2), torch.Generator().manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randint(0, V, (4, T), generator=g)
            census.begin_step(step)
            with lab.autocast("cpu", torch.bfloat16):
                logits = model(x)
            F.cross_entropy(logits.float().reshape(-1, V), x.reshape(-1)).backward()
            census.end_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        key = lambda r: (r["step"], r["layer"], r["gemm"], r["role"])  # noqa: E731
        return sorted(census.taken, key=key)

    def gpt():
        torch.manual_seed(0)
        return create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)

    ours = run(convert(gpt(), create_recipe(lab_name)), hook=False)
    same = lambda a, b: all(a[c] == b[c] or (math.isnan(a[c]) and math.isnan(b[c])) for c in NUMBERS)  # noqa: E731
    for hook in (True, False):
        model = gpt()
        to_float8(model, recipe)
        theirs = run(model, hook)
        assert [r["layer"] for r in ours] == [r["layer"] for r in theirs] and len(ours) == 96
        differ = sum(not same(a, b) for a, b in zip(ours, theirs))
        assert differ == 0 if hook else differ > len(ours) // 2, (hook, differ)

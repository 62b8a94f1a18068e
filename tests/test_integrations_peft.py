"""peft (LoRA) in the lab's framework adapters, against the real packages: FP32 adapters over an FP16 base (the
base loaded with `.half()`, as users load it) train under accelerate, the transformers Trainer and Lightning Fabric,
recorded; FP16 adapters are refused before the first step with the fix (lab/scaling/adapters.py)."""
import csv
import importlib.metadata
import tomllib

import json
from collections import Counter

import pytest
import torch

from conftest import REPO

peft = pytest.importorskip("peft")  # requirements.txt installs it with the other integrations
pytest.importorskip("accelerate")
pytest.importorskip("transformers")
L = pytest.importorskip("lightning")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.tuners_utils import cast_adapter_dtype  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import lab.scaling  # noqa: E402
from lab.cli import main  # noqa: E402
from lab.diagnose import diagnose  # noqa: E402
from lab.diagnose.inspect import inspect_run  # noqa: E402
from lab.integrations.hf import close_recording, use_lab_scaler, use_lab_trainer  # noqa: E402
from lab.integrations.lightning import LabFabricPrecision, LabPrecision  # noqa: E402
from lab.numerics.contract import tensor_core_contract  # noqa: E402
from lab.scaling import FP16_TRAINABLE_FIX, TrainableDtypeError, check_trainable_dtypes  # noqa: E402

STEPS = 6
SCALE = 2.0 ** 22  # the first two steps overflow in the FP16 backward and are skipped; the rest train
FIX = "autocast_adapter_dtype=True"  # what every refusal names


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state in a process-wide singleton: each test builds its own."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def lora_gpt2(fp16_adapters=False):
    """A tiny GPT-2 loaded in FP16 (`.half()`), LoRA on c_attn: FP32 adapters (peft's default) or FP16 ones."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)).half()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True),
                           autocast_adapter_dtype=not fp16_adapters)
    adapters = torch.float16 if fp16_adapters else torch.float32
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {adapters}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def frozen(model):
    """The base's weights, copied: what training must leave untouched, bit for bit."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def lora_b(model):
    return [p for n, p in model.named_parameters() if "lora_B" in n]


def assert_adapters_trained_base_untouched(model, before):
    assert lora_b(model) and any(bool(b.detach().ne(0).any()) for b in lora_b(model))  # peft starts B at zero
    assert all(p.dtype == torch.float32 for p in trainable(model))
    now = dict(model.named_parameters())
    for name, p in before.items():
        assert now[name].dtype == torch.float16 and torch.equal(now[name].detach(), p), name


def token_batches(n=STEPS, batch=4):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (batch, 16), generator=g) for _ in range(n)]


def assert_recorded(folder, skipped):
    d = diagnose(folder)
    assert d.status == "ok" and d.steps == STEPS and d.skipped_steps == skipped
    state = inspect_run(folder)
    assert state["finished"] and state["steps"] == STEPS and state["skipped"] == skipped
    assert 0 < skipped < STEPS  # the scaler skipped overflow steps and the others trained


# --- FP32 adapters over an FP16 base: trained, recorded -------------------------------------------------------------
def test_accelerate_trains_fp32_lora_over_fp16_base_and_replays(tmp_path):
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = use_lab_scaler(acc, "dynamic", init_scale=SCALE, out=tmp_path / "rec", name="gpt2-lora", census_every=1,
                            log_every=2)
    model = lora_gpt2()
    before = frozen(model)
    model, opt = acc.prepare(model, torch.optim.AdamW(trainable(model), lr=1e-2))
    for ids in token_batches():
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    close_recording(acc)
    assert_adapters_trained_base_untouched(acc.unwrap_model(model), before)
    assert_recorded(tmp_path / "rec", scaler.skipped_steps)
    with open(tmp_path / "rec" / "census.csv", newline="") as f:
        assert "adapter_grad" in {r["source"] for r in csv.DictReader(f)}  # the census counts the adapters' own
    with open(tmp_path / "rec" / "adapters.csv", newline="") as f:  # lora_B over the steps, as the lab's runs log it
        rows = list(csv.DictReader(f))
    assert {r["adapter"] for r in rows} == {"transformer.h.0.attn.c_attn"}
    assert float(rows[0]["b_norm"]) == 0.0 and float(rows[-1]["b_norm"]) > 0  # skipped first, trained after
    assert diagnose(tmp_path / "rec").adapters["transformer.h.0.attn.c_attn"]["b_norm"] > 0
    assert main(["replay", str(tmp_path / "rec"), "--policy", "dynamic"]) == 0


def lm_data(n=STEPS * 4):
    return [{"input_ids": r, "labels": r} for r in torch.cat(token_batches())[:n]]


def trainer(tmp_path, model):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[],
                             disable_tqdm=True, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=lm_data())


def test_trainer_trains_fp32_lora_over_fp16_base(tmp_path):
    model = lora_gpt2()
    before = frozen(model)
    t = trainer(tmp_path, model)
    scaler = use_lab_trainer(t, "dynamic", init_scale=SCALE, out=tmp_path / "rec", name="gpt2-lora")
    t.train()
    assert_adapters_trained_base_untouched(model, before)
    assert_recorded(tmp_path / "rec", scaler.skipped_steps)
    assert t.lr_scheduler.last_epoch == STEPS - scaler.skipped_steps  # skipped steps do not advance the schedule


def test_fabric_trains_fp32_lora_over_fp16_base(tmp_path):
    plugin = LabFabricPrecision("dynamic", init_scale=SCALE, out=tmp_path / "rec", name="gpt2-lora")
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    model = lora_gpt2()
    before = frozen(model)
    contract = []  # per forward: the FP16 base's output dtype, and whether the CPU contract was on
    model.base_model.model.lm_head.register_forward_hook(lambda m, i, o: contract.append((o.dtype, any(
        isinstance(x, tensor_core_contract) for x in torch.overrides._get_current_function_mode_stack()))))
    wrapped, opt = fabric.setup(model, torch.optim.AdamW(trainable(model), lr=1e-2))
    for ids in token_batches():
        fabric.backward(wrapped(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    fabric._strategy.teardown()  # closes the recording (metrics.json)
    # FP16 autocast under the CPU contract; the plugin's replays add their forwards (the FP32 census replays widen
    # the FP16 base: FP32 outputs)
    metrics = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert metrics["census_fp32_replays"] > 0
    assert Counter(contract) == Counter({(torch.float16, True): STEPS + metrics["attribution_replays"],
                                         (torch.float32, True): metrics["census_fp32_replays"]})
    assert_adapters_trained_base_untouched(model, before)
    assert_recorded(tmp_path / "rec", plugin.skipped_steps)


# --- FP16 adapters: refused before the first step, with the fix --------------------------------------------------
def assert_refusal(excinfo, n=2):
    msg = str(excinfo.value)
    assert f"{n} of {n} trainable parameter(s) are FP16" in msg and FIX in msg and "cast_adapter_dtype" in msg
    assert "lora_A.default.weight" in msg  # named where the names are known


def untouched(model):
    assert all(not bool(b.detach().ne(0).any()) for b in lora_b(model))


def test_trap_fused_adamw_trains_fp16_adapters_silently_and_accelerate_refuses_them_at_prepare():
    """A lab scaler put into accelerate by hand with a fused AdamW: the fused path takes FP16 gradients (as with
    torch.amp.GradScaler), so FP16 adapters train in FP16 without a word. use_lab_scaler refuses them in prepare()."""
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.native_amp, acc.scaler = True, lab.scaling.create("dynamic", device="cpu")
    model = lora_gpt2(fp16_adapters=True)
    model, opt = acc.prepare(model, torch.optim.AdamW(trainable(model), lr=1e-2, fused=True))
    for ids in token_batches(2):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    assert acc.scaler.steps == 2 and all(p.dtype == torch.float16 for p in trainable(model))
    assert any(bool(b.detach().ne(0).any()) for b in lora_b(model))  # trained, in FP16
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = use_lab_scaler(acc, "dynamic")
    model = lora_gpt2(fp16_adapters=True)
    with pytest.raises(TrainableDtypeError) as e:
        acc.prepare(model, torch.optim.AdamW(trainable(model), lr=1e-2))
    assert_refusal(e)
    assert scaler.steps == 0


def test_trainer_refuses_fp16_adapters_before_train(tmp_path):
    """Without the check the engine would stop the Trainer at its first step, after a forward and a backward (the
    Trainer unscales for its grad norm at every step); use_lab_trainer refuses before train()."""
    model = lora_gpt2(fp16_adapters=True)
    t = trainer(tmp_path, model)
    with pytest.raises(TrainableDtypeError) as e:
        use_lab_trainer(t, "dynamic")
    assert_refusal(e)
    untouched(model)


class LitLora(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def training_step(self, batch, i):
        self.calls += 1
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(trainable(self.model), lr=1e-2)


def test_lightning_trainer_and_fabric_refuse_fp16_adapters_before_any_step():
    lit = LitLora(lora_gpt2(fp16_adapters=True))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(token_batches())), batch_size=4)
    plugin = LabPrecision("dynamic")
    with pytest.raises(TrainableDtypeError) as e:
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(lit, loader)
    assert_refusal(e)
    assert lit.calls == 0 and plugin.scaler.steps == 0
    untouched(lit.model)
    model = lora_gpt2(fp16_adapters=True)
    fabric = L.Fabric(accelerator="cpu", plugins=[LabFabricPrecision("dynamic")])
    with pytest.raises(TrainableDtypeError) as e:
        fabric.setup(model, torch.optim.AdamW(trainable(model), lr=1e-2))
    assert_refusal(e)


def test_the_engine_by_hand_refuses_fp16_gradients_with_the_fix():
    """lab.scaling.create("dynamic") in your own loop: unscale_ stops with torch's words first, then the fix."""
    model = lora_gpt2(fp16_adapters=True)
    scaler = lab.scaling.create("dynamic", device="cpu")
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    ids = token_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.float16), tensor_core_contract():
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\. .*autocast_adapter_dtype=True"):
        scaler.step(opt)
    untouched(model)


def test_check_names_the_parameters_and_the_fixes_it_names_work():
    model = lora_gpt2(fp16_adapters=True)
    opt = torch.optim.SGD(trainable(model), lr=0.1)
    with pytest.raises(TrainableDtypeError, match=r"^2 of 2 trainable parameter\(s\) are FP16: ") as e:
        check_trainable_dtypes(opt)  # an optimizer alone: no names
    assert isinstance(e.value, ValueError) and FP16_TRAINABLE_FIX in str(e.value)
    with pytest.raises(TrainableDtypeError, match=r"\(base_model\.model\.transformer\.h\.0\.attn\.c_attn\.lora_A"):
        check_trainable_dtypes(opt, model=model)
    check_trainable_dtypes([p for p in model.parameters() if not p.requires_grad])  # the frozen FP16 base passes
    cast_adapter_dtype(model, adapter_name="default")  # the first fix the message names
    check_trainable_dtypes(model)
    model = lora_gpt2(fp16_adapters=True)
    for p in model.parameters():  # the second
        if p.requires_grad:
            p.data = p.data.float()
    check_trainable_dtypes(model)
    check_trainable_dtypes(torch.optim.SGD(trainable(model), lr=0.1))


# --- the `lab` command ---------------------------------------------------------------------------------------------
def test_the_lab_console_script_resolves_and_exits_with_mains_code(tmp_path, capsys):
    """pyproject.toml's `lab = "lab.cli:main"`, loaded as pip's launcher loads it; the launcher runs
    `sys.exit(main())`: main's return value is the exit status."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"lab": "lab.cli:main"}
    assert "peft" in project["project"]["optional-dependencies"]["integrations"]
    assert "peft==0.21.2" in (REPO / "requirements.txt").read_text().split()
    entry = importlib.metadata.EntryPoint(name="lab", value=project["project"]["scripts"]["lab"],
                                          group="console_scripts")
    fn = entry.load()
    assert fn is main
    with pytest.raises(SystemExit) as e:
        fn(["--help"])
    assert e.value.code == 0 and "replay" in capsys.readouterr().out
    assert fn(["inspect", str(tmp_path / "no-such-run")]) == 2  # bad input: exit status 2

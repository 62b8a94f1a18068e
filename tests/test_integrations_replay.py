"""The replay the framework adapters build (lab/integrations/: no user code): the Trainer's training_step, a
LightningModule's training_step, an accelerate or Fabric loop's forward when the loss is the model's own output. With it
a framework run's diagnosis measures underflow (each census step's micro-batch again in FP32, compared with its own
FP16 counts: checked against shares computed outside the recorder) and locates a forward overflow by module name;
``replay=False`` turns it off, and a loss computed outside the model gets none."""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lightning")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import lightning as L  # noqa: E402

from lab.diagnose import diagnose, format_text  # noqa: E402
from lab.integrations.hf import close_recording, use_lab_scaler, use_lab_trainer  # noqa: E402
from lab.integrations.lightning import LabPrecision  # noqa: E402

from test_record_accum import census_shares, outside_shares, share  # noqa: E402

VOCAB, CONTEXT = 256, 16


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def lm_rows(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, VOCAB, (n, CONTEXT), generator=g)]


def trainer(tmp_path, model, accum, steps=2):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=2, gradient_accumulation_steps=accum, learning_rate=1e-3,
                             report_to=[], disable_tqdm=True, save_strategy="no", dataloader_drop_last=True)
    return Trainer(model=model, args=args, train_dataset=lm_rows(2 * accum * steps))


def capture_micro_batches(t):
    """The inputs of each training_step call, in order (wrapped before the adapter wraps it)."""
    seen, step = [], t.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return step(model, inputs, num_items_in_batch)
    t.training_step = training_step
    return seen


@pytest.mark.parametrize("accum", [1, 8])
def test_a_trainer_run_has_its_underflow_measured_without_user_code(tmp_path, accum):
    """use_lab_trainer(..., out=) and nothing else: the census's FP32 replay runs the Trainer's training_step on the
    step's last micro-batch; step 0's flushed shares are that micro-batch's as computed outside (scale 1)."""
    t = trainer(tmp_path, gpt2(), accum)
    seen = capture_micro_batches(t)
    use_lab_trainer(t, "static", scale=1.0, out=tmp_path / "rec", census_every=1)
    t.train()
    metrics = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert metrics["census_fp32_replays"] == 2 and metrics["accum_steps"] == accum
    inputs, n_items = seen[accum - 1]  # step 0's last micro-batch
    expected = outside_shares(gpt2(), None, 1, loss_fn=lambda m: t.compute_loss(
        m, dict(inputs), num_items_in_batch=n_items) / (1 if n_items is not None else accum))
    got = census_shares(tmp_path / "rec")
    for source, counts in expected.items():
        assert got[source] == pytest.approx(share(counts), abs=1e-3), source
    d = diagnose(tmp_path / "rec")
    assert d.fp16_loss is not None and all(0 <= v["flushed"] <= 1 for v in d.fp16_loss["sources"].values())
    assert "underflow not measured" not in format_text(d)


@pytest.mark.parametrize("replay", [True, False])
def test_a_trainer_runs_forward_overflow_is_located_by_module_name(tmp_path, replay):
    """A planted forward overflow (the first block's MLP input projection's weights x 2e5, still within FP16's
    range: its output passes 65504 and the loss is NaN): the built replay of a skipped step names the module (with
    replay=False, the forward probed after an overflow step does), and the advice keeps that module in FP32."""
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(2e5)
    assert model.transformer.h[0].mlp.c_fc.weight.abs().max() < 65504
    t = trainer(tmp_path, model, 1, steps=4)
    use_lab_trainer(t, "dynamic", out=tmp_path / "rec", census_every=2, replay=replay)
    t.train()
    d = diagnose(tmp_path / "rec")
    text = format_text(d)
    assert d.forward_overflow and d.forward_overflow["module"] == "transformer.h.0.mlp.c_fc", text
    keep = next(r for r in d.recommendations if r.code == "keep_fp32")
    assert "transformer.h.0.mlp.c_fc" in keep.action, text
    metrics = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    # the replay found it, or without one the probe
    assert (metrics["attribution_replays"] > 0) == replay and (metrics["forward_probes"] > 0) == (not replay)


def test_replay_false_and_a_loss_outside_the_model_record_without_one(tmp_path):
    """replay=False: no replay (underflow not measured). An accelerate loop whose loss is computed outside the model
    has no exact replay: none is run; one whose loss is the model's own output gets it."""
    t = trainer(tmp_path, gpt2(), 1)
    use_lab_trainer(t, "static", scale=1.0, out=tmp_path / "off", census_every=1, replay=False)
    t.train()
    assert json.loads((tmp_path / "off" / "metrics.json").read_text())["census_fp32_replays"] == 0
    assert diagnose(tmp_path / "off").fp16_loss is None

    for name, outside in (("outside", True), ("own", False)):
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True, mixed_precision="fp16")
        use_lab_scaler(acc, "static", scale=1.0, out=tmp_path / name, census_every=1)
        model = gpt2()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for row in lm_rows(3):
            ids = row["input_ids"][None]
            out = model(input_ids=ids, labels=ids)
            loss = (torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:]) if outside
                    else out.loss)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        close_recording(acc)
        replays = json.loads((tmp_path / name / "metrics.json").read_text())["census_fp32_replays"]
        assert replays == (0 if outside else 3), name


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("loss", loss)  # logging inside training_step: muted in the replay
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_accumulate_grad_batches_compares_the_replayed_micro_batch(tmp_path):
    """accumulate_grad_batches 4: the plugin's replay runs the LightningModule's training_step on the step's last
    batch, its loss divided by 4 as Lightning divides it; step 0's shares are that micro-batch's."""
    module = LitGPT()
    loader = torch.utils.data.DataLoader(lm_rows(8), batch_size=2)
    plugin = LabPrecision("static", scale=1.0, out=tmp_path / "rec", census_every=1)
    L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=2, accumulate_grad_batches=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
              ).fit(module, loader)
    metrics = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert metrics["accum_steps"] == 4 and metrics["census_fp32_replays"] == 2
    last = torch.stack([r["input_ids"] for r in lm_rows(8)[6:8]])  # step 0's 4th batch (no shuffling)
    expected = outside_shares(gpt2(), last, 4)
    got = census_shares(tmp_path / "rec")
    for source, counts in expected.items():
        assert got[source] == pytest.approx(share(counts), abs=1e-3), source

"""The lab's scaler and recorder inside TRL's GRPOTrainer and DPOTrainer (trl from the registry, pinned in
requirements.txt), FP16 on the CPU under the tensor-core contract, a tiny GPT-2 on additions written in characters:
`use_lab_trainer(trainer, ..., out=)` as for any Trainer. From 2^40 the first steps overflow: they are skipped,
reported, the learning-rate schedule held on them, and `lab diagnose` reads the recordings."""
import copy
import json

import pytest
import torch

pytest.importorskip("trl")
from accelerate.state import AcceleratorState  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402

from lab.diagnose import diagnose  # noqa: E402
from lab.integrations.hf import use_lab_trainer  # noqa: E402

HIGH = 2.0 ** 40
QUIET = dict(use_cpu=True, fp16=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def tokenizer():
    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>"] + list("0123456789+=; "))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=0))


def pairs(n=32):
    return torch.randint(10, 99, (n, 2), generator=torch.Generator().manual_seed(0)).tolist()


def ones(completions, **kwargs):
    """A reward that varies within a group (the count of "1"s), so that the advantages and gradients are not zero."""
    return [float(c.count("1")) for c in completions]


def check(trainer, scaler, out, steps):
    assert scaler.skipped_steps > 0
    assert trainer.lr_scheduler.last_epoch == steps - scaler.skipped_steps  # the schedule held on skipped steps
    logged = [h for h in trainer.state.log_history if "skipped_steps" in h]
    assert logged and logged[-1]["skipped_steps"] == scaler.skipped_steps
    d = diagnose(out)
    assert d.status == "ok" and d.steps == steps and d.skipped_steps == scaler.skipped_steps


def test_grpo_trainer_with_the_lab_scaler_and_recorder(tmp_path):
    ds = Dataset.from_list([{"prompt": f"{a}+{b}="} for a, b in pairs()])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, learning_rate=1e-4, gradient_checkpointing=False, **QUIET)
    t = GRPOTrainer(model=gpt2(), reward_funcs=ones, args=args, train_dataset=ds, processing_class=tokenizer())
    scaler = use_lab_trainer(t, "dynamic", init_scale=HIGH, out=tmp_path / "rec")
    t.train()
    check(t, scaler, tmp_path / "rec", 6)


def test_dpo_trainer_with_the_lab_scaler_and_its_reference_model_in_fp16(tmp_path):
    """DPOTrainer prepares its reference model in __init__: allowed, and run under the same FP16 context."""
    rows = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b};", "rejected": f"{a + b + 1};"} for a, b in pairs()]
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                     gradient_checkpointing=False, **QUIET)
    model = gpt2()
    reference = copy.deepcopy(model)
    seen = []
    reference.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    t = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                   processing_class=tokenizer())
    scaler = use_lab_trainer(t, "dynamic", init_scale=HIGH, out=tmp_path / "rec")
    t.train()
    check(t, scaler, tmp_path / "rec", 6)
    # the reference's forward under FP16 autocast, as the policy's; FP32 only inside the census's FP32 replays of a step
    replays = json.loads((tmp_path / "rec" / "metrics.json").read_text())["census_fp32_replays"]
    assert seen.count(torch.float16) >= 6 and seen.count(torch.float32) == replays


def test_gradient_checkpointing_under_the_cpu_contract_trains(tmp_path):
    """TRL's configs turn gradient checkpointing on: its recompute runs under the contract
    (tests/test_grad_checkpoint.py checks the gradients against a run without it)."""
    ds = Dataset.from_list([{"prompt": f"{a}+{b}="} for a, b in pairs(8)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, gradient_checkpointing=True, **QUIET)
    t = GRPOTrainer(model=gpt2(), reward_funcs=ones, args=args, train_dataset=ds, processing_class=tokenizer())
    use_lab_trainer(t, "dynamic")
    t.train()
    assert t.state.global_step == 1 and t.model.transformer.gradient_checkpointing

"""LoRA fine-tuning over a base model, as FP16 users do it: the base's weights loaded in the run's precision (FP16
for an FP16 mode: `model.half()` then `get_peft_model`, the way a T4 or V100 user loads a model), frozen; the
adapters trainable and FP32 (peft's `autocast_adapter_dtype`, its default).

`ModelConfig.finetune` (configs/finetune.yaml) names the base run and the adapters; the workflow trains the base
first (its run folder is an input of every fine-tune job) and each fine-tune records the base weights' SHA-256
(metrics.json `base_model`). The modes keep their meaning: fp32 fine-tunes an FP32 base with no autocast (the
reference), fp16 modes an FP16 base under FP16 autocast with the mode's loss scaling, bf16 a BF16 base.
``base_quant: nf4`` (QLoRA): the base's linear layers then hold torchao's NF4 codes, dequantized to that dtype
(lab/models/nf4.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
from pathlib import Path

import torch

from lab.core import runfiles
from lab.models.nf4 import BASE_QUANTS, nf4_storage, quantize_nf4

WEIGHTS = "weights.pt"  # a base run's final weights (train.save_weights), a state_dict
BASE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class BaseModelError(ValueError):
    """The base model cannot be loaded: no weights in its run folder, or weights of another shape."""


def weights_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_base_weights(base_run: str | Path) -> Path:
    """The base run's weights file, or a BaseModelError naming where it was expected."""
    path = Path(base_run) / WEIGHTS
    if not path.is_file():
        raise BaseModelError(f"model.finetune.base_run: expected the base model's weights at {path} (a run trained "
                             f"with train.save_weights: true); found nothing there")
    return path


def lora_over_base(model: torch.nn.Module, *, precision: str, base_run: str, rank: int = 8, alpha: int = 16,
                   targets=("qkv", "proj", "fc"), dropout: float = 0.0, base: dict | None = None,
                   adapter_dtype: str = "fp32", base_quant: str = "none") -> torch.nn.Module:
    """``model`` (freshly built, the base's architecture) with the base run's weights, cast to the precision's
    dtype (its linear layers then quantized to NF4 when ``base_quant`` is "nf4": QLoRA), wrapped by peft with LoRA
    adapters on the modules named ``targets``. ``base``: the study's {family, mode, seed} of the base run
    (recorded, not used). ``adapter_dtype`` "base": the adapters in the base's dtype (peft's
    autocast_adapter_dtype=False: the mistake that FP16 training refuses before its first step)."""
    # built for its names and shapes only (the faults' check, lab/core/run_checks.py): no weights read, so a base
    # run that has not trained yet (a study's validation) is no refusal
    on_meta = any(p.is_meta for p in model.parameters())
    path = Path(base_run) / WEIGHTS if on_meta else check_base_weights(base_run)
    state = {} if on_meta else runfiles.read_tensors(path, map_location="cpu")  # RunFileError when cut
    try:
        if not on_meta:
            model.load_state_dict(state)
    except RuntimeError as e:
        raise BaseModelError(f"{path}: the weights do not fit this model ({str(e).splitlines()[0]}); the base run "
                             "must use the same preset, vocabulary and context") from None
    model.to(BASE_DTYPES[precision])
    return _with_adapters(model, precision, rank, alpha, targets, dropout, adapter_dtype, base_quant,
                          base_run=str(base_run), weights_sha256=None if on_meta else weights_sha256(path),
                          **({"base": base} if base else {}))


def _with_adapters(model: torch.nn.Module, precision: str, rank: int, alpha: float, targets, dropout: float,
                   adapter_dtype: str, base_quant: str, fan_in_fan_out: bool = False, **source) -> torch.nn.Module:
    """``model`` (the base, in the precision's dtype; its linear layers quantized to NF4 first when ``base_quant``
    is "nf4") wrapped by peft's get_peft_model with LoRA on ``targets``, FP32 adapters unless ``adapter_dtype`` is
    "base"; ``lab_base`` records where the base came from (``source``), its dtype, its quantization and the
    adapters (metrics.json ``base_model``)."""
    from peft import LoraConfig, get_peft_model
    if base_quant not in BASE_QUANTS:
        raise BaseModelError(f"model.finetune.base_quant: expected one of {', '.join(BASE_QUANTS)}; found "
                             f"{base_quant!r}")
    quant = quantize_nf4(model) if base_quant == "nf4" else None
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout, bias="none",
                        fan_in_fan_out=fan_in_fan_out)
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == "fp32")
    peft_model.lab_base = {**source, "base_dtype": str(BASE_DTYPES[precision]).replace("torch.", ""),
                           **({"base_quant": quant} if quant else {}),
                           "adapters": {"rank": rank, "alpha": alpha, "targets": list(targets), "dropout": dropout}}
    return peft_model


@contextlib.contextmanager
def widened_to_fp32(model: torch.nn.Module):
    """The model's FP16/BF16 parameters and buffers as FP32 inside the block, restored after (exactly: FP32 holds
    every FP16/BF16 value). The census's FP32 replay of a step runs under it, so that an FP16 base computes in FP32
    there: the replay measures what FP16 lost, not FP16 again. A no-op for a model without low-precision tensors.
    An NF4 base's codes stay as they are: its weight dequantizes to the FP32 input's dtype (the same values)."""
    with _cast(model, torch.float32, lambda t: t.dtype in (torch.float16, torch.bfloat16)):
        yield


@contextlib.contextmanager
def cast_to(model: torch.nn.Module, dtype: torch.dtype):
    """Every floating-point parameter and buffer of the model in ``dtype`` inside the block (``model.half()`` for an
    evaluation in FP16, Hugging Face's fp16_full_eval), the original tensors put back after, bit for bit (FP32
    adapters are not rounded by it). An NF4 base's codes stay as they are (they dequantize to the input's dtype)."""
    with _cast(model, dtype, lambda t: t.is_floating_point()):
        yield


@contextlib.contextmanager
def _cast(model: torch.nn.Module, dtype: torch.dtype, which):
    """``which`` of the model's parameters and buffers (NF4 storage excluded) cast to ``dtype``, restored after."""
    keep = nf4_storage(model)
    chosen = [t for t in itertools.chain(model.parameters(), model.buffers()) if id(t) not in keep and which(t)]
    originals = [t.data for t in chosen]
    for t in chosen:
        t.data = t.data.to(dtype)
    try:
        yield
    finally:
        for t, data in zip(chosen, originals):
            t.data = data


class CausalLMLogits(torch.nn.Module):
    """A Hugging Face causal LM as the lab's loop calls a model: token ids in, logits out."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, idx):
        return self.lm(input_ids=idx).logits


def _hf_weights_sha256(folder: Path) -> str:
    """SHA-256 over the folder's weight files (safetensors or PyTorch bins, sorted by name)."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def lora_over_hf(*, precision: str, base_model: str, vocab_size: int, context: int, rank: int = 8, alpha: int = 16,
                 targets=("c_attn",), dropout: float = 0.0, adapter_dtype: str = "fp32",
                 base_quant: str = "none") -> torch.nn.Module:
    """LoRA over a causal LM from a local Hugging Face folder (nothing is downloaded), loaded in the precision's
    dtype (FP16 for an FP16 mode, as `from_pretrained(..., torch_dtype=torch.float16)`), frozen; FP32 adapters."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = Path(base_model).expanduser()
    if not (folder / "config.json").is_file():
        raise BaseModelError(f"model.finetune.base_model: expected a Hugging Face model folder with config.json at "
                             f"{folder}; found none")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    n_vocab = getattr(config, "vocab_size", None)
    n_ctx = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if n_vocab is not None and vocab_size > n_vocab:
        raise BaseModelError(f"{folder}: the model's vocabulary has {n_vocab} tokens, the data's {vocab_size}: prepare "
                             f"the data with the model's own tokenizer (prepare-text --gpt2-files {folder})")
    if n_ctx is not None and context > n_ctx:
        raise BaseModelError(f"{folder}: data.context {context} is longer than the model's {n_ctx} positions")
    lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=BASE_DTYPES[precision], local_files_only=True)
    # GPT-2's Conv1D stores its weight transposed: peft needs to be told (it would correct it with a warning)
    conv1d = any(type(m).__name__ == "Conv1D" for n, m in lm.named_modules() if n.split(".")[-1] in targets)
    return _with_adapters(CausalLMLogits(lm), precision, rank, alpha, targets, dropout, adapter_dtype, base_quant,
                          fan_in_fan_out=conv1d, base_model=str(folder), weights_sha256=_hf_weights_sha256(folder))

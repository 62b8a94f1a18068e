"""The loss a run trains with (flat_cross_entropy) and its evaluation: score_batch, evaluate (one process),
evaluate_sharded and rank_slice (a sharded model's ranks), eval_batch_size (what one batch's logits may take),
evaluation_precision (train.eval_precision: what the evaluation computes in)."""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from lab.numerics.precision import autocast_for


def flat_cross_entropy(label_smoothing: float = 0.0):
    """Cross-entropy over the last dimension of the logits, every other dimension flattened into rows: one
    label per sample for a classifier (batch, classes), one per token for a language model (batch, time,
    vocab)."""
    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               label_smoothing=label_smoothing)
    return loss


#: bytes per logit an evaluation batch holds at its peak: the model's half-precision output, its FP32 copy and the
#: loss's log-softmax (2 + 4 + 4)
EVAL_LOGIT_BYTES = 10
#: what one evaluation batch's logits may take: GPT-2 small's are 1024 x 50,257 per window (515 MB by the count
#: above), so 256 windows would need 132 GB after all of training
EVAL_LOGITS_BUDGET = 2 * 2**30


def eval_batch_size(task: str, num_classes: int, input_size: int, batch_size: int,
                    budget: int = EVAL_LOGITS_BUDGET) -> int:
    """Examples per evaluation batch: the training batch, at least 256, as long as the batch's logits fit
    ``budget`` (EVAL_LOGIT_BYTES per logit; a language model has context x vocabulary of them per window)."""
    logits = num_classes * (input_size if task == "lm" else 1)
    return max(1, min(max(256, batch_size), budget // (logits * EVAL_LOGIT_BYTES)))


def score_batch(model, x, y, forward_context):
    """One evaluation batch on the device: (each example's hit as bool, its cross-entropy in FP32), one per image
    or per next token. What evaluate runs per batch and lab/run/sizing.py traces without data."""
    with forward_context:
        logits = model(x)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    return logits.argmax(-1) == y.reshape(-1), F.cross_entropy(logits, y.reshape(-1), reduction="none")


@torch.no_grad()
def evaluate(model, loader, device: str, precision: str, per_example: bool = False, prepare=None):
    """Validation top-1 (next-token accuracy for a language model) and mean cross-entropy in nats.

    With ``per_example`` also each example's outcome, in the loader's order (one per image, or per next token):
    (top1, loss, correct as a bool array, loss as a float32 array). The study's statistics resample examples
    (lab/study/inference.py): the test set is a sample too. Memory: one batch's logits at a time (eval_batch_size).
    ``prepare``: what a batch needs on the device before the model (DataBundle.prepare).
    """
    model.eval()
    correct = total = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    hits, losses = [], []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if prepare is not None:
            x = prepare(x)
        hit, loss = score_batch(model, x, y, autocast_for(precision, device))
        correct += hit.sum()
        loss_sum += loss.double().sum()
        total += y.numel()
        if per_example:
            hits.append(hit.cpu())
            losses.append(loss.cpu())
    model.train()
    top1, mean_loss = float(correct) / max(total, 1), float(loss_sum) / max(total, 1)
    if not per_example:
        return top1, mean_loss
    return (top1, mean_loss, torch.cat(hits).numpy().astype(bool) if hits else np.zeros(0, bool),
            torch.cat(losses).numpy().astype(np.float32) if losses else np.zeros(0, np.float32))


@contextlib.contextmanager
def evaluation_precision(model, setting: str | None, precision: str, device: str):
    """The precision a run evaluates in (``train.eval_precision``); yields the precision name ``evaluate`` takes.

    None: as the mode trains (``precision``: its autocast; Hugging Face's Trainer also evaluates under the training's
    autocast unless told otherwise). "fp32": the model's FP16/BF16 weights widened to FP32 (exact) and no autocast,
    the evaluation FP16 cannot move. "fp16-full": every floating-point weight cast to FP16 (``model.half()``,
    Hugging Face's fp16_full_eval; FP32 adapters rounded too) and no autocast: on a CPU the tensor-core contract on
    the stored FP16 operands, as a GPU runs a half model. The model's own tensors are put back after, bit for bit:
    training goes on as if no evaluation had run. An NF4 base's codes are left as they are in both."""
    if setting is None:
        yield precision
        return
    from lab.models.lora import cast_to, widened_to_fp32
    from lab.numerics.contract import tensor_core_contract
    if setting == "fp32":
        with widened_to_fp32(model):
            yield "fp32"
    elif setting == "fp16-full":
        on_cpu = torch.device(device).type == "cpu"
        with cast_to(model, torch.float16), (tensor_core_contract() if on_cpu else contextlib.nullcontext()):
            yield "fp32"
    else:
        raise ValueError(f"train.eval_precision: expected null, fp32 or fp16-full; found {setting!r}")


def rank_slice(n: int, rank: int, world: int) -> list[int]:
    """The validation examples one rank of a sharded run scores: a contiguous ceil(n / world), the last rank's
    padded with copies of the last example, so that every rank runs the same number of (collective) forwards."""
    per = -(-n // world)
    return [min(i, n - 1) for i in range(rank * per, (rank + 1) * per)]


def evaluate_sharded(model, loader, device: str, precision: str, d, n_examples: int, prepare=None):
    """evaluate on a sharded model whose ranks each hold a rank_slice of the validation set (``loader``): every
    rank's outcomes gathered in rank order, the padding dropped; (top1, loss, correct, loss per example) on every
    rank, equal to one process scoring the whole set (tests/test_evaluation.py)."""
    _, _, correct, loss = evaluate(model, loader, device, precision, per_example=True, prepare=prepare)
    parts = d.gather((correct, loss))
    per_example = len(correct) // max(len(loader.dataset), 1)  # next tokens per window for the LM, else 1
    correct = np.concatenate([c for c, _ in parts])[:n_examples * per_example]
    loss = np.concatenate([v for _, v in parts])[:n_examples * per_example]
    return float(correct.mean()) if len(correct) else 0.0, float(loss.astype(np.float64).mean()), correct, loss

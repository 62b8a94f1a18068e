"""digits-vqa: visual question answering on scikit-learn's digits, the multimodal family's task.

Each example is one digit image and one of four questions, answered by one word:

    what digit is this  -> "seven"            is this digit even -> "no"
    what digit comes next -> "eight"          is it above four   -> "yes"

The split is the digits' own (stratified by digit, `val_fraction`, `split_seed`): an image and its four questions
are on the same side, and the validation's independent unit is the image (``val.units``), not the question.

The input is packed into one FP32 row per example, the image's normalised pixels followed by the question's token
ids (exact in FP32): the training loop, its replays, the census, evaluation and sizing move one tensor per batch,
as for every other family. lab/models/multimodal.py unpacks it (`unpack`).
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lab.data.bundle import DataBundle

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTIONS = ("what digit is this", "is this digit even", "what digit comes next", "is it above four")
QUESTION_LEN = 4


def _vocabulary() -> list[str]:
    words = list(DIGITS) + ["yes", "no"]
    for q in QUESTIONS:
        words += [w for w in q.split() if w not in words]
    return words


VOCAB = _vocabulary()
WORD_ID = {w: i for i, w in enumerate(VOCAB)}


def answer(digit: int, question: int) -> str:
    """The one-word answer to question ``question`` about an image of ``digit``."""
    return (DIGITS[digit], "yes" if digit % 2 == 0 else "no", DIGITS[(digit + 1) % 10],
            "yes" if digit > 4 else "no")[question]


class DigitQuestions(Dataset):
    """Every (image, question) pair of ``images`` (N, C, H, W, normalised) and their digit ``labels``: example
    i is image i // 4 with question i % 4. ``units``: each example's image."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images.reshape(len(images), -1), labels
        self.questions = torch.tensor([[WORD_ID[w] for w in q.split()] for q in QUESTIONS], dtype=torch.float32)
        self.answers = torch.tensor([[WORD_ID[answer(d, q)] for q in range(len(QUESTIONS))] for d in range(10)])
        self.units = torch.arange(len(images)).repeat_interleave(len(QUESTIONS)).numpy()

    def __len__(self) -> int:
        return len(self.images) * len(QUESTIONS)

    def __getitem__(self, index: int):
        image, question = divmod(int(index), len(QUESTIONS))
        x = torch.cat([self.images[image], self.questions[question]])
        return x, self.answers[self.labels[image], question]


def digit_questions(digits: DataBundle) -> DataBundle:
    """The questions about a digits bundle's images (lab/data/datasets.py loads it: the same split)."""
    train_x, train_y = digits.train.tensors
    val_x, val_y = digits.val.tensors
    return DataBundle(
        train=DigitQuestions(train_x, train_y), val=DigitQuestions(val_x, val_y), num_classes=len(VOCAB),
        in_chans=1, name="digits-vqa", input_size=digits.input_size,
        description=f"{digits.description}, {len(QUESTIONS)} questions per image, {len(VOCAB)}-word vocabulary")

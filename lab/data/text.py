"""Text for the language-model family: documents, a word vocabulary, next-token windows.

* ``pydoc``: Python's own documentation, `pydoc_data.topics` (ships with every CPython: ~465 KB of English
  prose in 79 topic documents). Nothing to download, but the text is the running Python's: it changes between
  releases (3.11.2 and 3.11.7 differ by 1 KB), so a run records the corpus's hash (``corpus_provenance``) and two
  runs read the same text only where their hashes agree.
* ``text``: a local corpus: a ``.txt`` file (documents separated by blank lines) or a folder of ``.txt``
  files (one document each, read recursively in sorted order).

Documents are split into train/val with a fixed seed (whole documents, so no sentence is in both), the
vocabulary is the most frequent words of the training documents (ties broken alphabetically; id 0 is
``<unk>``), and each split's token stream is cut into non-overlapping windows of ``context + 1`` tokens:
input the first ``context``, target the next token at every position. ``MemmapWindows`` cuts the same windows
from a memory-mapped token file (data ``tokens``, prepared by lab/data/tokens.py).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
import platform
import os
import re
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lab.core.files import can_access

TOKEN = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")
UNK = "<unk>"


class TextDataError(ValueError):
    """A corpus that cannot be used; the message names the path and what was expected."""


def pydoc_documents() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics
    return sorted(topics.items())


def read_corpus(path: str | Path) -> list[tuple[str, str]]:
    """(name, text) documents from a .txt file or a folder of .txt files."""
    root = Path(path).expanduser()
    if not root.exists():
        raise TextDataError(f"text corpus {root}: expected a .txt file or a folder of them; found nothing there "
                            f"(it does not exist)")
    if root.is_dir() and not can_access(root, os.R_OK | os.X_OK):
        raise TextDataError(f"text corpus {root}: expected a folder this user can read; found one it cannot "
                            f"(mode {root.stat().st_mode & 0o777:o})")
    files = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
    if not files:
        raise TextDataError(f"text corpus {root}: expected .txt files in the folder; found none")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TextDataError(f"text corpus file {f}: expected UTF-8 text; found {e.reason} at byte "
                                f"{e.start}") from None
        except OSError as e:
            raise TextDataError(f"text corpus file {f}: expected a readable file; found one that cannot be read "
                                f"({e.strerror})") from None
        if root.is_dir():
            docs.append((str(f.relative_to(root)), text))
        else:
            docs += [(f"{f.name}#{i}", part) for i, part in enumerate(re.split(r"\n\s*\n", text)) if part.strip()]
    docs = [(name, text) for name, text in docs if TOKEN.search(text)]
    if not docs:
        raise TextDataError(f"text corpus {root}: expected words; found none")
    return docs


@functools.lru_cache(maxsize=4)
def documents(name: str, path: str | None) -> tuple[tuple[str, str], ...]:
    """The corpus's (name, text) documents, read once per process for its token streams and its provenance."""
    return tuple(pydoc_documents() if name == "pydoc" else read_corpus(path))


@functools.lru_cache(maxsize=4)
def corpus_provenance(name: str, path: str | None) -> dict:
    """What a run's provenance.json records of its text corpus: where it came from, its documents, and a SHA-256 over
    their names and texts (pydoc's text depends on the Python release, a local corpus on its files)."""
    docs = documents(name, path)
    h = hashlib.sha256()
    for doc_name, text in docs:
        h.update(doc_name.encode() + b"\0" + text.encode() + b"\0")
    if name == "pydoc":  # the module's own path: a carried copy (benchmarks/gpu/gpu_carry.sh) is not this Python's
        import pydoc_data.topics
        where = f"{pydoc_data.topics.__file__} (run by Python {platform.python_version()})"
    else:
        where = str(path)
    return {"corpus": where, "documents": len(docs), "corpus_sha256": h.hexdigest()}


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text)


def build_vocab(token_lists, size: int) -> list[str]:
    counts = collections.Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [UNK] + [word for word, _ in ranked[: size - 1]]


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    if n_docs < 2:
        raise TextDataError(f"a train/val split needs at least 2 documents, the corpus has {n_docs}")
    order = np.random.default_rng(seed).permutation(n_docs)
    n_val = min(max(1, round(val_fraction * n_docs)), n_docs - 1)
    return sorted(order[n_val:].tolist()), sorted(order[:n_val].tolist())


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream: (tokens[i:i+T], tokens[i+1:i+T+1]). ``doc_starts``: where each
    document begins in the stream, when known (the study's unit of resampling, lab/run/outcomes.py)."""

    def __init__(self, stream: torch.Tensor, context: int, doc_starts=None):
        self.stream, self.context, self.doc_starts = stream, context, doc_starts

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.context

    def __getitem__(self, i):
        start = i * self.context
        chunk = self.stream[start: start + self.context + 1]
        return chunk[:-1], chunk[1:]


class MemmapWindows(TokenWindows):
    """TokenWindows over a token file (lab/data/tokens.py) through np.memmap: the same (x, y) int64 windows as
    TokenWindows over the same ids, read from the page cache when asked for; nothing of the corpus is copied into
    the process. The map is opened lazily and not pickled, so each DataLoader worker maps the file instead of
    receiving a copy."""

    def __init__(self, path, dtype: str, n_tokens: int, context: int):
        self.path, self.dtype, self.n_tokens, self.context, self._map = str(path), dtype, n_tokens, context, None

    @property
    def stream(self):
        if self._map is None:  # a plain ndarray view of the map: slicing it is faster than slicing a np.memmap
            self._map = np.asarray(np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,)))
        return self._map

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.context

    def __getitem__(self, i):
        start = i * self.context
        chunk = torch.from_numpy(self.stream[start: start + self.context + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self):
        return dict(self.__dict__, _map=None)


def targets(windows: TokenWindows) -> torch.Tensor:
    """Every next-token target the windows hold, in order (what evaluation scores)."""
    return windows.stream[1: len(windows) * windows.context + 1]


def _chunks(stream, size: int = 1 << 22):
    """``stream`` (a tensor, or a memory-mapped token file) as int64 tensors of ``size`` tokens: a token file is
    read a few MB at a time, never copied whole."""
    for i in range(0, len(stream), size):
        part = stream[i: i + size]
        yield part if isinstance(part, torch.Tensor) else torch.from_numpy(part.astype(np.int64))


def baselines(train: TokenWindows, val: TokenWindows, vocab_size: int) -> dict:
    """Validation loss (nats per token) of two models that need no training: the uniform guess (ln V) and the
    unigram model, word frequencies fitted on the training targets (add-one smoothing, so no token has
    probability 0). A language model that has not beaten the unigram has not yet learned which words are
    common."""
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for part in _chunks(targets(train)):
        counts += torch.bincount(part, minlength=vocab_size)
    logp = (counts / counts.sum()).log()
    val_targets = targets(val)
    total = sum(float(logp[part].sum()) for part in _chunks(val_targets))
    return {"val_loss_uniform": math.log(vocab_size), "val_loss_unigram": -total / len(val_targets)}


PARTS = ("pretrain", "finetune")


def split_parts(n_docs: int, seed: int) -> dict[str, list[int]]:
    """The corpus in two disjoint halves of whole documents (a seeded permutation): a base model pretrains on one,
    its fine-tunes train on the other."""
    if n_docs < 4:
        raise TextDataError(f"a pretrain/finetune split needs at least 4 documents (2 per part), the corpus has "
                            f"{n_docs}")
    order = np.random.default_rng(seed + 7919).permutation(n_docs)
    half = n_docs // 2
    return {"pretrain": sorted(order[:half].tolist()), "finetune": sorted(order[half:].tolist())}


@functools.lru_cache(maxsize=4)
def load_corpus(name: str, path: str | None, vocab_size: int, val_fraction: float, split_seed: int,
                part: str | None = None):
    """Token streams (train, val), the vocabulary and the validation documents (name, tokens), computed once per
    process. ``part`` (pretrain | finetune): one half of the documents (split_parts), split into train/val in turn;
    both halves use the pretrain half's vocabulary, so a fine-tune reads its base model's token ids."""
    docs = documents(name, path)
    tokens = [tokenize(text) for _, text in docs]
    if len(docs) < 2:
        raise TextDataError(f"text corpus {path}: expected at least 2 documents for a train/val split (paragraphs "
                            f"separated by a blank line, or .txt files); found {len(docs)}")
    if part is not None:
        parts = split_parts(len(docs), split_seed)
        base_train, _ = _split_within(parts["pretrain"], val_fraction, split_seed)
        train_ids, val_ids = _split_within(parts[part], val_fraction, split_seed)
        vocab = build_vocab([tokens[i] for i in base_train], vocab_size)
    else:
        train_ids, val_ids = split_documents(len(docs), val_fraction, split_seed)
        vocab = build_vocab([tokens[i] for i in train_ids], vocab_size)
    index = {w: i for i, w in enumerate(vocab)}

    def stream(ids):
        return torch.tensor([index.get(t, 0) for i in ids for t in tokens[i]], dtype=torch.long)
    # the validation documents as (name, tokens): their boundaries in the val stream
    return stream(train_ids), stream(val_ids), vocab, [(docs[i][0], len(tokens[i])) for i in val_ids]


def _split_within(ids: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    train, val = split_documents(len(ids), val_fraction, seed)
    return [ids[i] for i in train], [ids[i] for i in val]


def load_text(name: str, path: str | None, context: int, vocab_size: int, val_fraction: float, split_seed: int,
              part: str | None = None):
    """(train windows, val windows, vocabulary, description) for the data config."""
    train, val, vocab, val_docs = load_corpus(name, path, vocab_size, val_fraction, split_seed, part)
    where = ("pydoc_data.topics" if name == "pydoc" else str(path)) + (f" ({part} half)" if part else "")
    for split, s in (("train", train), ("val", val)):
        if len(s) < context + 1:
            raise TextDataError(f"text corpus {where}: expected at least data.context + 1 = {context + 1} tokens "
                                f"in the {split} split; found {len(s)} (use a larger corpus or a smaller "
                                f"data.context)")
    unk = float((train == 0).float().mean())
    desc = (f"{where}: {len(train)} train / {len(val)} val word tokens ({len(val_docs)} val documents), "
            f"vocabulary {len(vocab)} ({100 * unk:.1f}% of train tokens <unk>), context {context}")
    starts = np.concatenate([[0], np.cumsum([n for _, n in val_docs])[:-1]]).astype(np.int64)
    return TokenWindows(train, context), TokenWindows(val, context, doc_starts=starts), vocab, desc

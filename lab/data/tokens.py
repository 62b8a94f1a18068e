"""Token files for the language model: a corpus tokenized once, with a byte-level BPE, into memory-mapped
``train.bin`` / ``val.bin`` (nanoGPT's layout), and the windows training reads from them.

``python -m lab prepare-text --corpus PATH --out DIR`` writes to DIR:

* ``tokenizer.json``: the Hugging Face `tokenizers` byte-level BPE: trained on the first ``--sample-mb`` MB of
  the corpus (training keeps every distinct pre-token in memory, so it is bounded by the sample, not the corpus),
  or GPT-2's own ``vocab.json`` + ``merges.txt`` from a local folder (``--gpt2-files``; nothing is downloaded).
* ``train.bin``, ``val.bin``: flat arrays of token ids (uint16 for a vocabulary of at most 65535, else uint32);
  each document's tokens followed by the end-of-text token, as nanoGPT's prepare scripts write them.
* ``meta.json``: dtype, vocabulary, token counts, the corpus's and the tokenizer's SHA-256. Written last: a
  folder without it is unfinished, and the loader refuses it.

Documents are the corpus's ``.txt`` files (a folder, read recursively in sorted order) or the blank-line
separated blocks of one file (as lab/data/text.py reads them); a document goes to val when a hash of its index
falls below ``--val-fraction``, so the split needs no pass over the corpus first. The corpus is read as a
stream (lines of at most 1 MB, documents encoded in pieces of ~1 MB and batches of ~4 MB), so memory does not
grow with the corpus. While preparing, the token files grow as ``.train.bin.partial`` / ``.val.bin.partial``,
and ``.progress.json`` records after every batch how far they are complete: an interrupted preparation resumes
from there. A folder prepared from another corpus or tokenizer is refused, never mixed (``--force`` replaces it).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

from lab.core import files, lock  # numpy, torch and tokenizers are imported where used
from lab.data.bundle import DataBundle, DataError

FORMAT = "lab-tokens/1"
EOT = "<|endoftext|>"
LINE_CHARS = 1 << 20     # a longer line is read in parts: memory stays bounded whatever the file holds
PIECE_CHARS = 1 << 20    # a longer document is encoded in pieces cut at line ends
BATCH_CHARS = 4 << 20    # text per encode_batch call and per progress record
SPLITS = ("train", "val")
ITEMSIZE = {"uint16": 2, "uint32": 4}


class TokenDataError(ValueError):
    """A corpus, tokenizer or prepared folder that cannot be used; the message names the path and the fix."""


# --- reading the corpus ------------------------------------------------------------------------------------
def corpus_files(root: Path) -> list[Path]:
    """The corpus's files: the .txt file itself, or a folder's .txt files in sorted order (as text.read_corpus)."""
    if not root.exists():
        raise TokenDataError(f"corpus {root}: expected a .txt file or a folder of them; found nothing there")
    found = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
    if not found:
        raise TokenDataError(f"corpus {root}: expected .txt files in the folder; found none")
    return found


def _header(root: Path, f: Path) -> bytes:
    """What the corpus hash takes before a file's bytes: its name and size (a renamed file changes the hash)."""
    name = f.name if f == root else str(f.relative_to(root))
    return f"{name}\0{f.stat().st_size}\0".encode()


def corpus_sha256(root: Path) -> tuple[str, int]:
    """SHA-256 over every file's name, size and bytes (streamed), and the corpus's size in bytes."""
    h, size = hashlib.sha256(), 0
    for f in corpus_files(root):
        h.update(_header(root, f))
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
                size += len(block)
    return h.hexdigest(), size


class _HashingFile(io.RawIOBase):
    """A file whose bytes also go into a hash as they are read: the tokenizing pass re-checks the corpus hash."""

    def __init__(self, f, h):
        self.f, self.h = f, h

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.h.update(memoryview(b)[:n])
        return n

    def close(self):
        self.f.close()
        super().close()


def _lines(root: Path, f: Path, h):
    raw = _HashingFile(open(f, "rb", buffering=0), h)
    h.update(_header(root, f))
    with io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding="utf-8") as text:
        try:
            yield from iter(lambda: text.readline(LINE_CHARS), "")
        except UnicodeDecodeError as e:
            raise TokenDataError(f"corpus file {f}: expected UTF-8 text; found {e.reason}") from None


def iter_pieces(root: Path, h=None):
    """(document index, text, is the document's last piece) over the corpus, in order. A document is a file of a
    folder, or a blank-line separated block of a single file; whitespace-only documents are skipped."""
    h = h if h is not None else hashlib.sha256()
    doc, single = 0, not root.is_dir()
    for f in corpus_files(root):
        parts, chars, has_text, started = [], 0, False, False
        for line in _lines(root, f, h):
            blank = not line.strip()
            if single and blank:  # a blank line ends the block (the block's last newline is the separator's)
                if has_text or started:
                    yield doc, "".join(parts)[:-1], True
                    doc += 1
                parts, chars, has_text, started = [], 0, False, False
                continue
            parts.append(line)
            chars += len(line)
            has_text = has_text or not blank
            if chars >= PIECE_CHARS and has_text:  # the last newline waits: it may be the separator's
                piece = "".join(parts)
                yield doc, piece[:-1], False
                parts, chars, has_text, started = [piece[-1]], 1, False, True
        if has_text or started:
            yield doc, "".join(parts), True
            doc += 1


def is_val(doc: int, val_fraction: float) -> bool:
    """The split by document: a hash of the index (no pass over the corpus first; the same on every machine)."""
    digest = hashlib.blake2b(str(doc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < val_fraction


# --- the tokenizer -----------------------------------------------------------------------------------------
def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenDataError("prepare-text needs Hugging Face tokenizers (pip install tokenizers; it comes with "
                             "transformers)") from None
    return tokenizers


def _byte_level(model):
    hf = _tokenizers()
    tok = hf.Tokenizer(model)
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's pre-tokenization
    tok.decoder = hf.decoders.ByteLevel()
    return tok


def tokenizer_spec(vocab_size: int | None, gpt2_files: str | None, sample_mb: float) -> dict:
    """What identifies the tokenizer before it is built: what a rerun compares with the prepared folder's."""
    if gpt2_files:
        folder = Path(gpt2_files).expanduser()
        need = [folder / "vocab.json", folder / "merges.txt"]
        missing = [p.name for p in need if not p.is_file()]
        if missing:
            raise TokenDataError(f"--gpt2-files {folder}: expected GPT-2's vocab.json and merges.txt; "
                                 f"{' and '.join(missing)} not found")
        return {"kind": "gpt2", **{f"{p.name}_sha256": hashlib.sha256(p.read_bytes()).hexdigest() for p in need}}
    return {"kind": "bpe", "vocab_size": vocab_size, "sample_bytes": int(sample_mb * 1e6)}


def build_tokenizer(spec: dict, root: Path, gpt2_files: str | None):
    hf = _tokenizers()
    if spec["kind"] == "gpt2":
        folder = Path(gpt2_files).expanduser()
        tok = _byte_level(hf.models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
        tok.add_special_tokens([EOT])  # already in GPT-2's vocabulary (50256): marks it as never split
        return tok
    tok = _byte_level(hf.models.BPE())
    trainer = hf.trainers.BpeTrainer(vocab_size=spec["vocab_size"], special_tokens=[EOT], show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sample(root, spec["sample_bytes"]), trainer)
    return tok


def _sample(root: Path, limit: int):
    """The corpus's first ``limit`` characters, in pieces: what the BPE is trained on."""
    seen = 0
    for _, text, _ in iter_pieces(root):
        yield text
        seen += len(text)
        if seen >= limit:
            return


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- preparing ---------------------------------------------------------------------------------------------
def prepare(corpus, out, vocab_size: int = 50257, gpt2_files: str | None = None, val_fraction: float = 0.01,
            sample_mb: float = 64.0, force: bool = False, on_batch=None, log=print) -> dict:
    """Tokenize ``corpus`` into ``out`` (see the module docstring); returns meta.json's contents plus
    ``status`` (prepared, resumed or unchanged) and ``timings``. ``on_batch(n)`` is called after the n-th batch
    is recorded (tests interrupt there)."""
    root, out = Path(corpus).expanduser(), Path(out).expanduser()
    if not 0 < val_fraction < 1:
        raise TokenDataError(f"--val-fraction: expected a number in (0, 1); found {val_fraction}")
    t0 = time.perf_counter()
    corpus_hash, corpus_bytes = corpus_sha256(root)
    key = {"format": FORMAT, "corpus_sha256": corpus_hash,
           "tokenizer": tokenizer_spec(vocab_size, gpt2_files, sample_mb), "val_fraction": val_fraction}
    out.mkdir(parents=True, exist_ok=True)
    lock.hold(out / ".lock", doing=f"another process (pid {{pid}}) is preparing tokens in {out}")
    try:
        if _unchanged(out, key, force):
            log(f"{out}: already prepared from this corpus with this tokenizer; nothing to do")
            return {**json.loads((out / "meta.json").read_text()), "status": "unchanged"}
        timings = {"hash_s": time.perf_counter() - t0}
        return _prepare_into(root, out, key, gpt2_files, corpus_bytes, timings, on_batch, log)
    finally:
        lock.release(out / ".lock")


def _unchanged(out: Path, key: dict, force: bool) -> bool:
    """True when ``out`` holds a complete preparation of ``key``; refuses one of another key unless ``force``."""
    meta_path = out / "meta.json"
    if not meta_path.exists():
        return False
    meta = json.loads(meta_path.read_text())
    old = {k: meta.get(k) for k in key}
    old["tokenizer"] = meta.get("tokenizer", {}).get("spec")
    if old == key and not force:
        check_files(out, meta)
        return True
    if not force:
        changed = [k for k in key if old[k] != key[k]]
        what = {"corpus_sha256": "corpus", "tokenizer": "tokenizer", "val_fraction": "split", "format": "format"}
        raise TokenDataError(f"{out} holds tokens prepared from another {' and '.join(what[k] for k in changed)} "
                             f"({'; '.join(f'{k}: {old[k]}, now {key[k]}' for k in changed)}); refusing to mix "
                             f"them: use another --out folder, or --force to replace them")
    meta_path.unlink()  # first: from here on the folder is unfinished, whatever the loader finds in it
    return False


def _prepare_into(root, out, key, gpt2_files, corpus_bytes, timings, on_batch, log) -> dict:
    progress = _resume_point(out, key)
    resumed, t0 = progress is not None, time.perf_counter()
    if not resumed:
        tok = build_tokenizer(key["tokenizer"], root, gpt2_files)
        files.atomic_write_text(out / "tokenizer.json", tok.to_str())
        progress = {**key, "tokenizer_sha256": _sha256_file(out / "tokenizer.json"),
                    "vocab_size": tok.get_vocab_size(), "pieces": 0, "documents": 0, "val_documents": 0,
                    "train": 0, "val": 0}
        for split in SPLITS:
            (out / f".{split}.bin.partial").write_bytes(b"")
        files.atomic_write_json(out / ".progress.json", progress)  # a rerun resumes with this tokenizer
        log(f"{out}: tokenizer ready ({key['tokenizer']['kind']}, {tok.get_vocab_size()} tokens)")
    else:
        tok = _tokenizers().Tokenizer.from_file(str(out / "tokenizer.json"))
        log(f"{out}: resuming an interrupted preparation after {progress['documents']} documents")
    timings["tokenizer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    progress = _encode(root, out, tok, progress, on_batch)
    timings["encode_s"] = time.perf_counter() - t0
    meta = _finish(out, key, tok, progress, corpus_bytes, timings)
    log(f"{out}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens ({meta['dtype']})")
    return {**meta, "status": "resumed" if resumed else "prepared"}


def _resume_point(out: Path, key: dict) -> dict | None:
    """The progress of an interrupted preparation of ``key`` whose files are all still there, else None (and
    what another key left behind is of no use: it is overwritten)."""
    try:
        progress = json.loads((out / ".progress.json").read_text())
    except (OSError, ValueError):
        return None
    if any(progress.get(k) != v for k, v in key.items()):
        return None
    tok = out / "tokenizer.json"
    if not tok.is_file() or _sha256_file(tok) != progress["tokenizer_sha256"]:
        return None
    itemsize = ITEMSIZE[dtype_for(progress["vocab_size"])]
    for split in SPLITS:
        part = out / f".{split}.bin.partial"
        if not part.is_file() or part.stat().st_size < progress[split] * itemsize:
            return None  # written less far than recorded (a crash of the machine): start again
        os.truncate(part, progress[split] * itemsize)  # drop what came after the last record
    return progress


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65535 else "uint32"


def _encode(root: Path, out: Path, tok, progress: dict, on_batch) -> dict:
    """Append every piece after ``progress['pieces']`` to the partial files, a batch at a time, recording the
    progress after each batch; checks the corpus hash read along the way."""
    h, batch, chars = hashlib.sha256(), [], 0
    writer = _TokenWriter(out, tok, progress, on_batch)
    try:
        for i, piece in enumerate(iter_pieces(root, h)):
            if i < progress["pieces"]:
                continue  # done before the interruption (still read: the hash covers it)
            batch.append(piece)
            chars += len(piece[1])
            if chars >= BATCH_CHARS:
                writer.write(batch)
                batch, chars = [], 0
        writer.write(batch)
    finally:
        writer.close()
    if h.hexdigest() != progress["corpus_sha256"]:
        (out / ".progress.json").unlink()
        raise TokenDataError(f"corpus {root} changed while it was being tokenized (its SHA-256 differs from the "
                             f"one taken at the start); prepare again once it is complete")
    return writer.progress


class _TokenWriter:
    """The partial token files of a preparation, and the record (.progress.json) of how far they are complete.
    ``on_batch(n)`` is called after the n-th batch is recorded."""

    def __init__(self, out: Path, tok, progress: dict, on_batch):
        self.out, self.tok, self.progress, self.on_batch, self.batches = out, tok, dict(progress), on_batch, 0
        self.dtype, self.eot = dtype_for(progress["vocab_size"]), tok.token_to_id(EOT)
        self.sinks = {s: open(out / f".{s}.bin.partial", "ab") for s in SPLITS}

    def write(self, batch: list) -> None:
        """Encode a batch of pieces, append each to its split's file, then record the new lengths."""
        import numpy as np
        ids, progress = {s: [] for s in SPLITS}, self.progress
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        for (doc, _, last), enc in zip(batch, encode([text for _, text, _ in batch], add_special_tokens=False)):
            split = "val" if is_val(doc, progress["val_fraction"]) else "train"
            ids[split].append(np.asarray(enc.ids + [self.eot] if last else enc.ids, dtype=self.dtype))
            if last:
                progress["documents"] += 1
                progress["val_documents"] += split == "val"
        for split, arrays in ids.items():
            if arrays:
                block = np.concatenate(arrays)
                self.sinks[split].write(block.tobytes())
                progress[split] += len(block)
            self.sinks[split].flush()
            os.fsync(self.sinks[split].fileno())  # on disk before the record that says so
        progress["pieces"] += len(batch)
        files.atomic_write_json(self.out / ".progress.json", progress)
        self.batches += 1
        if self.on_batch is not None:
            self.on_batch(self.batches)

    def close(self) -> None:
        for f in self.sinks.values():
            f.close()


def _finish(out: Path, key: dict, tok, progress: dict, corpus_bytes: int, timings: dict) -> dict:
    """Rename the token files into place and write meta.json (last: the folder is complete from then on)."""
    for split, docs in (("train", progress["documents"] - progress["val_documents"]),
                        ("val", progress["val_documents"])):
        if docs == 0:
            raise TokenDataError(f"no document of the {progress['documents']} fell in the {split} split "
                                 f"(--val-fraction {key['val_fraction']}): use a corpus with more documents "
                                 f"(blank-line separated blocks, or files) or another --val-fraction")
    for split in SPLITS:
        os.replace(out / f".{split}.bin.partial", out / f"{split}.bin")
    vocab = progress["vocab_size"]
    meta = {"format": FORMAT, "dtype": dtype_for(vocab), "vocab_size": vocab, "eot_id": tok.token_to_id(EOT),
            "train_tokens": progress["train"], "val_tokens": progress["val"],
            "documents": progress["documents"], "val_documents": progress["val_documents"],
            "val_fraction": key["val_fraction"], "split": "val when blake2b-64(document index) / 2^64 < val_fraction",
            "corpus_sha256": key["corpus_sha256"], "corpus_bytes": corpus_bytes,
            "tokenizer": {"kind": key["tokenizer"]["kind"], "vocab_size": vocab,
                          "sha256": progress["tokenizer_sha256"], "spec": key["tokenizer"],
                          "library": f"tokenizers {_tokenizers().__version__}"},
            "prepared": files.now_iso(), "timings_s": {k: round(v, 3) for k, v in timings.items()}}
    files.atomic_write_json(out / "meta.json", meta)
    (out / ".progress.json").unlink()
    return meta


# --- reading the prepared folder ---------------------------------------------------------------------------
def read_meta(path) -> dict:
    folder = Path(path).expanduser()
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        raise TokenDataError(f"tokens data path {folder}: expected a folder prepared by `python -m lab "
                             f"prepare-text` (with meta.json); found none (unfinished? prepare it again: it "
                             f"resumes)") from None
    if meta.get("format") != FORMAT:
        raise TokenDataError(f"tokens data path {folder}: expected format {FORMAT}; found {meta.get('format')!r}")
    check_files(folder, meta)
    return meta


def check_files(folder: Path, meta: dict) -> None:
    """The token files and the tokenizer are the ones meta.json describes (sizes, hash), not half or other files."""
    itemsize = ITEMSIZE[meta["dtype"]]
    for split in SPLITS:
        f, want = folder / f"{split}.bin", meta[f"{split}_tokens"] * itemsize
        size = f.stat().st_size if f.exists() else None
        if size != want:
            raise TokenDataError(f"{f}: expected {want} bytes ({meta[f'{split}_tokens']} tokens, meta.json); found "
                                 f"{'no file' if size is None else f'{size} bytes'}: prepare the folder again "
                                 f"with --force")
    tok = folder / "tokenizer.json"
    if not tok.is_file() or _sha256_file(tok) != meta["tokenizer"]["sha256"]:
        raise TokenDataError(f"{tok}: expected the tokenizer the tokens were made with (SHA-256 "
                             f"{meta['tokenizer']['sha256'][:12]}..., meta.json); found another or none")


def load_windows(path, context: int, vocab_size: int):
    """(train windows, val windows, meta, description) of a prepared folder, for data ``name: tokens``."""
    folder = Path(path).expanduser()
    meta = read_meta(folder)
    if vocab_size < meta["vocab_size"]:
        raise TokenDataError(f"data.vocab_size {vocab_size}: expected at least the tokenizer's vocabulary "
                             f"{meta['vocab_size']} ({folder / 'meta.json'}); a larger one pads the embedding")
    for split in SPLITS:
        if meta[f"{split}_tokens"] < context + 1:
            raise TokenDataError(f"tokens data path {folder}: expected at least data.context + 1 = {context + 1} "
                                 f"tokens in the {split} split; found {meta[f'{split}_tokens']}")
    from lab.data.text import MemmapWindows
    train, val = (MemmapWindows(folder / f"{s}.bin", meta["dtype"], meta[f"{s}_tokens"], context) for s in SPLITS)
    tok = meta["tokenizer"]
    desc = (f"{folder}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens ({meta['val_documents']} val "
            f"documents), {tok['kind']} tokenizer of {tok['vocab_size']} tokens (sha256 {tok['sha256'][:12]}), "
            f"context {context}, memory-mapped {meta['dtype']}")
    return train, val, meta, desc


def load_bundle(path, context: int, vocab_size: int):
    """The DataBundle of data ``name: tokens`` (lab/data/datasets.py load_data): the memory-mapped windows, and the
    token files' provenance, which the run records."""
    if path is None:
        raise DataError("dataset 'tokens' needs a path to a folder prepared by `python -m lab prepare-text`")
    try:
        train, val, meta, desc = load_windows(path, context, vocab_size)
    except TokenDataError as e:
        raise DataError(str(e)) from None
    return DataBundle(train, val, num_classes=vocab_size, in_chans=0, name="tokens", description=desc,
                      input_size=context, task="lm", provenance=provenance(path, meta))


def provenance(folder, meta: dict) -> dict:
    """What a run records of its token files: where, which corpus, which tokenizer."""
    return {"tokens": str(Path(folder).expanduser().resolve()), "format": meta["format"], "dtype": meta["dtype"],
            "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
            "corpus_sha256": meta["corpus_sha256"],
            "tokenizer": {k: meta["tokenizer"][k] for k in ("kind", "vocab_size", "sha256")}}

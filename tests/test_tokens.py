"""Token files for the language model (lab/data/tokens.py, `python -m lab prepare-text`): what preparation writes,
resuming an interrupted preparation, refusing a changed corpus or tokenizer, and training windows read from the
memory map equal to the in-memory path's (lab/data/text.py)."""
import io
import json

import numpy as np
import pytest
import torch
import yaml

from lab.cli import main as cli
from lab.core.config import resolve_run, validate_study
from lab.data import tokens
from lab.data.datasets import DataError, load_data, make_loader
from lab.data.text import MemmapWindows, TokenWindows, baselines, load_corpus, pydoc_documents, read_corpus
# imported here, at collection, not first by cli() inside a capfd test: train()'s default progress stream is the
# sys.stderr of its first import, which would be that test's, closed after it
from lab.run.train import train

from conftest import REPO, tiny_study
from test_resume import drive

VOCAB = 400


@pytest.fixture
def corpus(tmp_path):
    """One .txt file of 40 documents (pydoc topics, blank lines inside them make more) and its text."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(text for _, text in pydoc_documents()[:40]))
    return path


def prepare(corpus, out, **kw):
    return tokens.prepare(corpus, out, **{"vocab_size": VOCAB, "val_fraction": 0.1, "log": lambda m: None, **kw})


def expected_streams(corpus, out, val_fraction=0.1):
    """The token streams computed here the simple way: every document encoded whole, in memory, end-of-text
    after each, documents assigned to splits by tokens.is_val."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tok.token_to_id(tokens.EOT)
    streams = {"train": [], "val": []}
    for i, (_, text) in enumerate(read_corpus(corpus)):
        split = "val" if tokens.is_val(i, val_fraction) else "train"
        streams[split] += tok.encode(text, add_special_tokens=False).ids + [eot]
    return streams


def test_preparation_writes_the_documents_tokens_and_meta(corpus, tmp_path):
    out = tmp_path / "out"
    meta = prepare(corpus, out)
    assert meta["status"] == "prepared" and meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB
    want = expected_streams(corpus, out)
    for split in ("train", "val"):
        got = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert got.tolist() == want[split] and meta[f"{split}_tokens"] == len(want[split])
    assert meta["documents"] == len(read_corpus(corpus)) and 0 < meta["val_documents"] < meta["documents"]
    # the byte-level BPE loses nothing: the first training document's tokens decode to its text
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    first = next(text for i, (_, text) in enumerate(read_corpus(corpus)) if not tokens.is_val(i, 0.1))
    assert tok.decode(want["train"][: want["train"].index(meta["eot_id"])]) == first
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["corpus_sha256"] == tokens.corpus_sha256(corpus)[0]
    assert on_disk["tokenizer"]["sha256"] == tokens._sha256_file(out / "tokenizer.json")
    assert on_disk["tokenizer"]["spec"] == {"kind": "bpe", "vocab_size": VOCAB, "sample_bytes": 64_000_000}
    assert not list(out.glob(".*.partial")) and not (out / ".progress.json").exists()
    assert prepare(corpus, out)["status"] == "unchanged"  # the same corpus and tokenizer: nothing to do


def test_documents_are_read_as_the_in_memory_path_reads_them(corpus, tmp_path, monkeypatch):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / "sub" / f"d{i}.txt").write_text(f"document {i}\n\nwith a blank line\n" * 50)
    (folder / "blank.txt").write_text("  \n\n")
    monkeypatch.setattr(tokens, "PIECE_CHARS", 300)  # long documents come in pieces; joined, they are the same
    for root in (corpus, folder):
        docs = {}
        for doc, text, _ in tokens.iter_pieces(root):
            docs[doc] = docs.get(doc, "") + text
        assert list(docs.values()) == [text for _, text in read_corpus(root)]
        assert max(len(t) for _, t, last in tokens.iter_pieces(root) if not last) < 300 + 100


def test_interrupted_preparation_resumes_to_the_same_files(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "BATCH_CHARS", 4000)  # many batches, so there is a middle to stop in
    clean, clean_batches = tmp_path / "clean", []
    prepare(corpus, clean, on_batch=clean_batches.append)

    class Killed(Exception):
        pass

    def stop_at_3(n):
        if n == 3:
            raise Killed
    out = tmp_path / "out"
    with pytest.raises(Killed):
        prepare(corpus, out, on_batch=stop_at_3)
    # nothing looks complete: no meta.json, no train.bin; the loader says so
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
    with pytest.raises(DataError, match="meta.json"):
        load_data("tokens", str(out), context=8, vocab_size=VOCAB)
    progress = json.loads((out / ".progress.json").read_text())
    assert progress["pieces"] > 0 and progress["train"] > 0
    # a kill between a write and its record leaves bytes after the recorded end: they are dropped on resume
    with open(out / ".train.bin.partial", "ab") as f:
        f.write(b"\x07\x00" * 11)
    batches = []
    meta = prepare(corpus, out, on_batch=batches.append)
    assert meta["status"] == "resumed"
    assert len(batches) == len(clean_batches) - 3  # it went on from where the third batch had ended
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert meta["train_tokens"] == json.loads((clean / "meta.json").read_text())["train_tokens"]


def test_restart_after_an_interruption_with_other_settings_starts_afresh(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "BATCH_CHARS", 4000)
    out = tmp_path / "out"

    def stop(n):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, on_batch=stop)
    meta = prepare(corpus, out, vocab_size=VOCAB + 50)  # another tokenizer: the partial files are not reused
    assert meta["status"] == "prepared" and meta["vocab_size"] == VOCAB + 50
    assert expected_streams(corpus, out)["train"] == np.fromfile(out / "train.bin", np.uint16).tolist()


def test_changed_corpus_or_tokenizer_is_refused_unless_forced(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["prepare-text", "--corpus", str(corpus), "--out", str(out), "--vocab-size", str(VOCAB),
            "--val-fraction", "0.1"]
    assert cli(args) == 0 and cli(args) == 0
    assert '"status": "unchanged"' in capsys.readouterr().out
    before = (out / "train.bin").read_bytes()
    corpus.write_text(corpus.read_text() + "\n\nOne more document at the end.\n")
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "corpus_sha256" in err and "--force" in err and str(out) in err
    assert (out / "train.bin").read_bytes() == before and (out / "meta.json").exists()  # left as it was
    assert cli(args[:-4] + ["--vocab-size", str(VOCAB + 1), "--val-fraction", "0.1"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert cli(args + ["--force"]) == 0
    assert json.loads((out / "meta.json").read_text())["corpus_sha256"] == tokens.corpus_sha256(corpus)[0]


def test_gpt2_files_give_the_same_tokens_and_their_change_is_refused(corpus, tmp_path):
    trained = tmp_path / "trained"
    prepare(corpus, trained)
    from tokenizers import Tokenizer
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    Tokenizer.from_file(str(trained / "tokenizer.json")).model.save(str(gpt2))  # vocab.json + merges.txt
    out = tmp_path / "out"
    meta = prepare(corpus, out, gpt2_files=str(gpt2))
    assert meta["tokenizer"]["kind"] == "gpt2" and meta["vocab_size"] == VOCAB
    assert (out / "train.bin").read_bytes() == (trained / "train.bin").read_bytes()
    merges = gpt2 / "merges.txt"
    merges.write_text("\n".join(merges.read_text().splitlines()[:-5]) + "\n")  # another tokenizer's merges
    with pytest.raises(tokens.TokenDataError, match="merges.txt_sha256"):
        prepare(corpus, out, gpt2_files=str(gpt2))
    with pytest.raises(tokens.TokenDataError, match="vocab.json"):
        prepare(corpus, out, gpt2_files=str(tmp_path))


def test_a_second_preparation_into_the_same_folder_is_refused_by_the_lock(corpus, tmp_path):
    """While one prepare-text holds the output folder (lab/core/lock.py), a second exits 2 naming its PID."""
    import subprocess
    import sys
    out = tmp_path / "tokens"
    out.mkdir()
    from test_jobs import hold_lock
    holder = hold_lock(out / ".lock")
    try:
        res = subprocess.run([sys.executable, "-m", "lab", "prepare-text", "--corpus", str(corpus), "--out", str(out),
                              "--vocab-size", str(VOCAB)], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"another process (pid {holder.pid}) is preparing tokens in {out}" in res.stderr
    assert not (out / "meta.json").exists()


def test_memmap_windows_equal_the_in_memory_windows(tmp_path):
    """The same token ids through both paths: the in-memory stream (lab/data/text.py, pydoc) written as a token
    file and memory-mapped gives the same windows, the same shuffled batches and the same baselines."""
    train, val, vocab, _ = load_corpus("pydoc", None, 1024, 0.1, 0)
    for name, stream in (("train", train), ("val", val)):
        stream.numpy().astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    memory = [TokenWindows(s, 32) for s in (train, val)]
    mapped = [MemmapWindows(tmp_path / f"{n}.bin", "uint16", len(s), 32) for n, s in (("train", train), ("val", val))]
    assert len(mapped[0]) == len(memory[0]) and len(mapped[1]) == len(memory[1])
    for i in (0, 1, len(memory[0]) // 2, len(memory[0]) - 1):
        (xm, ym), (xf, yf) = memory[0][i], mapped[0][i]
        assert xf.dtype == xm.dtype == torch.int64 and torch.equal(xf, xm) and torch.equal(yf, ym)
    batches = [list(zip(range(5), make_loader(w, 64, shuffle=True, seed=3, drop_last=True)))
               for w in (memory[0], mapped[0])]
    for (_, (xm, ym)), (_, (xf, yf)) in zip(*batches):
        assert torch.equal(xm, xf) and torch.equal(ym, yf)
    assert baselines(*mapped, len(vocab)) == pytest.approx(baselines(*memory, len(vocab)), rel=1e-12)
    # a worker process gets the file's path, not a pickled copy of its tokens
    import pickle
    assert len(pickle.dumps(mapped[0])) < 1000


def test_training_reads_the_token_files_and_records_them(corpus, tmp_path):
    from lab.run.train import train
    out = tmp_path / "out"
    meta = prepare(corpus, out)
    bundle = load_data("tokens", str(out), context=16, vocab_size=VOCAB)
    assert bundle.task == "lm" and bundle.num_classes == VOCAB and isinstance(bundle.train, MemmapWindows)
    want = torch.tensor(np.fromfile(out / "train.bin", np.uint16).astype(np.int64))
    x, y = bundle.train[5]
    assert torch.equal(x, want[80:96]) and torch.equal(y, want[81:97])
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "tokens", "path": str(out), "context": 16,
                                                             "vocab_size": VOCAB},
                              "train": {"batch_size": 8, "max_steps": 2}}}
    run = resolve_run(validate_study(study), "lm", "fp32", 0)
    metrics = train(run, tmp_path / "run", progress=io.StringIO())
    assert metrics["status"] == "ok" and metrics["vocab_size"] == VOCAB and "memory-mapped" in metrics["data"]
    prov = json.loads((tmp_path / "run" / "provenance.json").read_text())["data"]
    assert prov["corpus_sha256"] == meta["corpus_sha256"] and prov["train_tokens"] == meta["train_tokens"]
    assert prov["tokenizer"] == {"kind": "bpe", "vocab_size": VOCAB, "sha256": meta["tokenizer"]["sha256"]}


@pytest.mark.parametrize("damage", ["truncated", "tokenizer replaced", "vocab too small", "no path"])
def test_damaged_or_mismatched_token_folder_is_refused(corpus, tmp_path, damage):
    out = tmp_path / "out"
    prepare(corpus, out)
    vocab, path = VOCAB, str(out)
    if damage == "truncated":
        data = (out / "train.bin").read_bytes()
        (out / "train.bin").write_bytes(data[: len(data) // 2])
    elif damage == "tokenizer replaced":
        (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<eot>"'))
    elif damage == "vocab too small":
        vocab = VOCAB - 1
    else:
        path = None
    with pytest.raises(DataError) as err:
        load_data("tokens", path, context=16, vocab_size=vocab)
    expect = {"truncated": "train.bin", "tokenizer replaced": "tokenizer.json", "vocab too small": "data.vocab_size",
              "no path": "prepare-text"}[damage]
    assert expect in str(err.value)


def test_corpus_changed_while_tokenizing_is_refused(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "BATCH_CHARS", 4000)

    def edit_corpus(n):
        if n == 2:
            corpus.write_text(corpus.read_text().replace("the", "THE"))
    with pytest.raises(tokens.TokenDataError, match="changed while"):
        prepare(corpus, tmp_path / "out", on_batch=edit_corpus)
    assert not (tmp_path / "out" / "meta.json").exists()


KILLED_CHILD = """
import sys, time
from lab.data import tokens
tokens.BATCH_CHARS = 4000
tokens.prepare(sys.argv[1], sys.argv[2], vocab_size={vocab}, val_fraction=0.1, log=lambda m: None,
               on_batch=lambda n: time.sleep(0.05))
"""


def test_preparation_killed_with_sigkill_resumes_to_the_same_files(corpus, tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD.format(vocab=VOCAB), str(corpus), str(out)],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    progress = out / ".progress.json"
    deadline = time.time() + 60
    while time.time() < deadline and not (progress.exists() and json.loads(progress.read_text())["pieces"]):
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert json.loads(progress.read_text())["pieces"] > 0 and not (out / "meta.json").exists()
    monkeypatch.setattr(tokens, "BATCH_CHARS", 4000)
    assert prepare(corpus, out)["status"] == "resumed"
    clean = tmp_path / "clean"
    prepare(corpus, clean)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name


def test_resume_on_tokens_prepared_again_from_another_corpus_is_refused(corpus, tmp_path, capfd):
    """The run's config names the token folder; its checkpoint holds the corpus's and tokenizer's hashes. The
    folder prepared again (--force) from another corpus under a checkpointed run: the resume is refused with
    exit status 2 naming what differs, nothing mixed; on the original tokens it resumes."""
    out = tmp_path / "out"
    prepare(corpus, out)
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "tokens", "path": str(out), "context": 16,
                                                             "vocab_size": VOCAB},
                              "train": {"batch_size": 8, "max_steps": 6, "checkpoint_every": 1}}}
    study["modes"] = {"fp32": {"precision": "fp32"}}
    study = validate_study(study)
    run_dir = tmp_path / "run"
    # the kill: in a process forked from this one (test_resume.drive)
    done = drive({"study": study, "model": "lm", "mode": "fp32", "seed": 0, "out": str(run_dir), "kill": "micro:3"})
    assert done.returncode == -9, done.stderr[-2000:]
    saved = (out / "train.bin").read_bytes()
    corpus.write_text(corpus.read_text() + "\n\nanother document, another corpus")
    prepare(corpus, out, force=True)
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    # `python -m lab train` in this process (lab.cli.main, what lab/__main__.py calls), then the run resumed in this
    # process: the kill above is what needed a process of its own (two more cost ~5 s each of importing torch)
    cmd = ["train", "--model", "lm", "--mode", "fp32", "--seed", "0", "--out", str(run_dir), "--config", str(config)]
    capfd.readouterr()
    refused = cli(cmd)
    err = capfd.readouterr().err
    assert refused == 2 and "corpus_sha256" in err, err[-2000:]
    assert not (run_dir / "metrics.json").exists()
    corpus.write_text(corpus.read_text().replace("\n\nanother document, another corpus", ""))
    prepare(corpus, out, force=True)
    assert (out / "train.bin").read_bytes() == saved
    log = io.StringIO()
    metrics = train(resolve_run(study, "lm", "fp32", 0), run_dir, progress=log)
    assert metrics["status"] == "ok" and "resuming from" in log.getvalue(), log.getvalue()[-2000:]

"""The language model's data (lab/data/text.py through lab.data.datasets.load_data) and its runs: splits by document,
vocabulary from the training documents only, next-token windows, local corpora, clear errors; runs of one
seed share initial weights and data order across modes (what the paired statistics rely on)."""
import io
import json

import pytest
import torch

from lab.core.config import resolve_run, validate_study
from lab.data.datasets import DataError, load_data
from lab.data.text import UNK, pydoc_documents, split_documents, tokenize
from lab.run.train import train

from conftest import tiny_study


def test_pydoc_corpus_is_deterministic_and_split_by_document():
    a = load_data("pydoc", context=16, vocab_size=256, val_fraction=0.1, split_seed=0)
    b = load_data("pydoc", context=16, vocab_size=256, val_fraction=0.1, split_seed=0)
    assert a.task == "lm" and a.input_size == 16 and a.num_classes == 256 and a.in_chans == 0
    assert torch.equal(a.train.stream, b.train.stream) and torch.equal(a.val.stream, b.val.stream)
    other = load_data("pydoc", context=16, vocab_size=256, val_fraction=0.1, split_seed=1)
    assert not torch.equal(a.val.stream, other.val.stream)
    n_docs = len(pydoc_documents())
    train_ids, val_ids = split_documents(n_docs, 0.1, 0)
    assert not set(train_ids) & set(val_ids) and len(train_ids) + len(val_ids) == n_docs
    assert len(val_ids) == round(0.1 * n_docs)


def test_a_run_records_which_text_it_read(tmp_path):
    """pydoc_data.topics differs between Python releases: the bundle's provenance (written into provenance.json)
    hashes the documents it read, so a run on another Python (the GPU machine's) shows whether its text was the same."""
    import hashlib
    a = load_data("pydoc", context=16, vocab_size=256, val_fraction=0.1, split_seed=0).provenance
    h = hashlib.sha256()
    for name, text in pydoc_documents():
        h.update(f"{name}\0{text}\0".encode())
    assert a["corpus_sha256"] == h.hexdigest() and a["documents"] == len(pydoc_documents())
    (tmp_path / "one.txt").write_text("alpha beta\n\ngamma delta\n")
    (tmp_path / "two.txt").write_text("alpha beta\n\ngamma delta!\n")
    one, two = (load_data("text", path=str(tmp_path / f), context=1, vocab_size=8, val_fraction=0.5,
                          split_seed=0).provenance for f in ("one.txt", "two.txt"))
    assert one["documents"] == two["documents"] == 2 and one["corpus_sha256"] != two["corpus_sha256"]


def test_vocabulary_comes_from_training_documents_only():
    bundle = load_data("pydoc", context=16, vocab_size=10_000, val_fraction=0.1, split_seed=0)
    # every training word has an id; words seen only in validation documents are <unk> (id 0)
    assert int((bundle.train.stream == 0).sum()) == 0
    assert int((bundle.val.stream == 0).sum()) > 0


def test_windows_predict_the_next_token():
    bundle = load_data("pydoc", context=8, vocab_size=64, val_fraction=0.1, split_seed=0)
    x, y = bundle.train[3]
    assert x.shape == y.shape == (8,)
    assert torch.equal(x[1:], y[:-1])
    assert len(bundle.train) == (len(bundle.train.stream) - 1) // 8


def test_local_corpus_file_and_folder(tmp_path):
    text = "The quick brown fox.\n\nJumps over the lazy dog.\n\n" * 30
    f = tmp_path / "corpus.txt"
    f.write_text(text)
    bundle = load_data("text", str(f), context=4, vocab_size=32, val_fraction=0.2, split_seed=0)
    assert bundle.num_classes == len(set(tokenize(text))) + 1  # every word, plus <unk>
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        (folder / "sub" / f"d{i}.txt").write_text(f"document {i} says hello world again and again. " * 20)
    bundle = load_data("text", str(folder), context=4, vocab_size=32, val_fraction=0.2, split_seed=0)
    assert "1 val documents" in bundle.description


@pytest.mark.parametrize("kind", ["missing", "empty folder", "not utf-8", "too small", "no path", "pydoc path"])
def test_bad_corpus_is_refused_naming_the_path(tmp_path, kind):
    path = tmp_path / "corpus"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "not utf-8":
        path = tmp_path / "bad.txt"
        path.write_bytes(b"caf\xe9 au lait\n\nencore\n")
    elif kind == "too small":
        path = tmp_path / "small.txt"
        path.write_text("one two three\n\nfour five\n")
    name = "pydoc" if kind == "pydoc path" else "text"
    arg = None if kind == "no path" else str(path)
    with pytest.raises(DataError) as err:
        load_data(name, arg, context=64, vocab_size=32)
    msg = str(err.value)
    assert (str(path) in msg) if kind not in ("no path",) else ("path" in msg)


def test_lm_run_reports_bits_per_token_and_pairs_across_modes(tmp_path):
    study = tiny_study()
    study["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 16, "vocab_size": 128},
                              "train": {"batch_size": 8, "accum_steps": 2, "max_steps": 2}}}
    study = validate_study(study)
    metrics = {}
    for mode in ("fp32", "fp16-static128"):
        metrics[mode] = train(resolve_run(study, "lm", mode, 0), tmp_path / mode, progress=io.StringIO())
    m = metrics["fp16-static128"]
    assert m["task"] == "lm" and m["tokens_per_step"] == 8 * 16 * 2 and m["steps"] == 2
    assert m["val_bits_per_token"] == pytest.approx(m["final_val_loss"] / torch.log(torch.tensor(2.0)).item())
    assert m["val_perplexity"] == pytest.approx(torch.exp(torch.tensor(m["final_val_loss"])).item(), rel=1e-6)
    assert 0 <= m["final_top1"] <= 1 and m["vocab_size"] == 128
    # the same seed: the same initial weights and the same first batch, whatever the mode
    assert metrics["fp32"]["init_params_sha"] == m["init_params_sha"]
    assert metrics["fp32"]["first_batch_sha"] == m["first_batch_sha"]
    other = train(resolve_run(study, "lm", "fp32", 1), tmp_path / "seed1", progress=io.StringIO())
    assert other["init_params_sha"] != m["init_params_sha"] and other["first_batch_sha"] != m["first_batch_sha"]
    assert json.loads((tmp_path / "fp32" / "metrics.json").read_text())["final_val_loss"] > 0


def test_unknown_word_is_unk():
    bundle = load_data("pydoc", context=16, vocab_size=2, val_fraction=0.1, split_seed=0)
    assert bundle.num_classes == 2 and UNK == "<unk>"
    assert set(bundle.train.stream.unique().tolist()) <= {0, 1}


def test_baselines_are_the_uniform_and_add_one_unigram_cross_entropy():
    """ln V, and -mean log p(target) under add-one word frequencies of the training targets (computed here by
    hand in FP64 from the streams, not by the code under test)."""
    import math as m

    from lab.data.text import TokenWindows, baselines
    train = TokenWindows(torch.tensor([0, 1, 1, 2, 1, 3, 1]), context=3)   # targets 1 1 2 1 3 1
    val = TokenWindows(torch.tensor([3, 2, 2, 0, 1]), context=2)           # targets 2 2 0 1
    out = baselines(train, val, vocab_size=5)
    counts = {0: 1, 1: 5, 2: 2, 3: 2, 4: 1}   # 1 + occurrences among the training targets
    total = sum(counts.values())
    expected = -sum(m.log(counts[t] / total) for t in (2, 2, 0, 1)) / 4
    assert out["val_loss_uniform"] == m.log(5)
    assert out["val_loss_unigram"] == pytest.approx(expected, rel=1e-12)

"""Token files at scale: prepare a generated corpus once, then train from the memory map.

Generates a corpus of --size-mb MB under /tmp (Python's documentation, pydoc_data.topics, the text the CPU study
already uses: its topics shuffled and repeated, one document per blank-line separated block) and a tenth of it,
and measures, each in a child process of its own so that one measurement's memory is not another's:

* preparation (`lab.data.tokens.prepare`, byte-level BPE of --vocab-size trained on the first 64 MB): MB/s,
  and the peak memory above the interpreter (ru_maxrss minus the RSS after the imports), at both sizes: bounded
  means the same peak for 10x the corpus;
* today's in-memory path (lab/data/text.py, word vocabulary) on --inmemory-mb MB of the same text, for contrast;
* training-time memory: anonymous RSS (what the process owns) and file-backed RSS (page cache mapped in, shared
  and reclaimable) after opening the token files, after reading batches, after the unigram baseline's pass over
  every token; and the same tokens held in memory as text.py holds them (an int64 tensor);
* steps/s of gpt-tiny (FP32, one thread, context 32, batch 64) from the memory map and from the in-memory tensor
  of the same tokens, interleaved over --rounds in one process, the same batches for both.

The corpus and the prepared folders are deleted at the end (--keep keeps them).

    python benchmarks/speed/bench_tokens.py [--size-mb 500] [--vocab-size 8192] [--rounds 3] [--steps 40]
        [--out results/benchmarks/tokens.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lab.core import files  # noqa: E402

CONTEXT, BATCH = 32, 64  # the CPU study's LM shape (configs/default.yaml)


def rss_mb(kind: str = "VmRSS") -> float:
    """VmRSS, RssAnon or RssFile of this process, MB (/proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(kind)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


# --- the corpus --------------------------------------------------------------------------------------------
def make_corpus(path: Path, size_mb: float, seed: int = 0) -> int:
    """pydoc's topics, shuffled on every pass, blank-line separated, until the file holds size_mb MB."""
    from pydoc_data.topics import topics
    docs, rng, written = list(topics.values()), random.Random(seed), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_mb * 1e6:
            rng.shuffle(docs)
            block = "\n\n".join(docs) + "\n\n"
            f.write(block)
            written += len(block.encode())
    return path.stat().st_size


# --- child processes: one measurement each -----------------------------------------------------------------
def child_prepare(corpus: str, out: str, vocab: int) -> dict:
    from lab.data import tokens
    tokens._tokenizers()  # imported before the baseline: the interpreter with what preparing needs
    import numpy  # noqa: F401
    base = rss_mb()
    t0 = time.perf_counter()
    meta = tokens.prepare(corpus, out, vocab_size=vocab, val_fraction=0.01, log=lambda m: None)
    wall = time.perf_counter() - t0
    mb = meta["corpus_bytes"] / 1e6
    return {"corpus_mb": mb, "wall_s": wall, "mb_per_s": mb / wall,
            "encode_mb_per_s": mb / meta["timings_s"]["encode_s"], "timings_s": meta["timings_s"],
            "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"], "documents": meta["documents"],
            "bytes_per_token": meta["corpus_bytes"] / (meta["train_tokens"] + meta["val_tokens"]),
            "rss_after_imports_mb": base, "peak_rss_mb": peak_mb(), "peak_above_interpreter_mb": peak_mb() - base}


def child_inmemory(corpus: str) -> dict:
    from lab.data import text
    base = rss_mb()
    t0 = time.perf_counter()
    train, val, vocab, _ = text.load_corpus("text", corpus, 1024, 0.01, 0)
    wall = time.perf_counter() - t0
    mb = Path(corpus).stat().st_size / 1e6
    return {"corpus_mb": mb, "wall_s": wall, "mb_per_s": mb / wall, "tokens": len(train) + len(val),
            "peak_above_interpreter_mb": peak_mb() - base, "bytes_of_ram_per_byte": (peak_mb() - base) / mb}


def memory_now(base: dict) -> dict:
    return {k: round(rss_mb(k) - base[k], 1) for k in ("RssAnon", "RssFile")}


def child_train_memory(prepared: str, vocab: int) -> dict:
    import torch
    from lab.data.datasets import load_data, make_loader
    from lab.data.text import TokenWindows, baselines
    base = {k: rss_mb(k) for k in ("RssAnon", "RssFile")}
    bundle = load_data("tokens", prepared, context=CONTEXT, vocab_size=vocab)
    out = {"opened": memory_now(base)}
    for i, _ in zip(range(200), make_loader(bundle.train, BATCH, shuffle=True, seed=0)):
        pass
    out["after_200_batches"] = memory_now(base)
    baselines(bundle.train, bundle.val, vocab)
    out["after_unigram_pass"] = memory_now(base)
    held = TokenWindows(torch.from_numpy(bundle.train.stream.astype("int64")), CONTEXT)
    out["in_memory_int64"] = memory_now(base)
    out["train_tokens"] = held.stream.numel()
    return out


def child_steps(prepared: str, vocab: int, steps: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F
    from lab.data.datasets import load_data, make_loader
    from lab.data.text import TokenWindows
    from lab.models.presets import create_model
    torch.set_num_threads(1)
    mapped = load_data("tokens", prepared, context=CONTEXT, vocab_size=vocab).train
    memory = TokenWindows(torch.from_numpy(mapped.stream.astype("int64")), CONTEXT)
    paths = {"memmap": mapped, "in_memory": memory}
    torch.manual_seed(0)
    model = create_model("gpt-tiny", num_classes=vocab, in_chans=0, input_size=CONTEXT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaders = {k: iter(make_loader(w, BATCH, shuffle=True, seed=0, drop_last=True)) for k, w in paths.items()}
    rates = {k: [] for k in paths}
    fetch = {k: [] for k in paths}
    for _ in range(rounds):
        for name, loader in loaders.items():  # interleaved: both paths see the same machine load
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y = next(loader)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            rates[name].append(steps / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(steps * 10):
                next(loader)
            fetch[name].append(steps * 10 / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"steps_per_s": rates, "median_steps_per_s": med, "ratio_memmap_to_in_memory":
            med["memmap"] / med["in_memory"], "batches_fetched_per_s": {k: statistics.median(v) for k, v in
                                                                       fetch.items()},
            "steps": steps, "rounds": rounds, "threads": 1, "context": CONTEXT, "batch_size": BATCH}


CHILDREN = {"prepare": child_prepare, "inmemory": child_inmemory, "train-memory": child_train_memory,
            "steps": child_steps}


def in_child(name: str, *args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{name}: {json.dumps(result)[:400]}", flush=True)
    return result


# --- the run -----------------------------------------------------------------------------------------------
def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), None)
    import platform
    return {"cpu": name or files.cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)}


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lab-bench-tokens-", dir="/tmp"))
    try:
        big, small = tmp / "corpus.txt", tmp / "corpus-tenth.txt"
        t0 = time.perf_counter()
        size = make_corpus(big, args.size_mb)
        make_corpus(small, args.size_mb / 10)
        mem = tmp / "corpus-inmemory.txt"
        make_corpus(mem, min(args.inmemory_mb, args.size_mb))
        print(f"corpus: {size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", flush=True)
        result = {"command": " ".join(["python", "benchmarks/speed/bench_tokens.py", *sys.argv[1:]]),
                  "machine": machine(), "date": files.now_iso(), "load_average_1min_at_start": os.getloadavg()[0],
                  "vocab_size": args.vocab_size,
                  "corpus": "pydoc_data.topics shuffled and repeated, blank-line separated documents"}
        result["prepare"] = in_child("prepare", big, tmp / "tokens", args.vocab_size)
        result["prepare_tenth"] = in_child("prepare", small, tmp / "tokens-tenth", args.vocab_size)
        result["rerun_unchanged_s"] = timed_rerun(big, tmp / "tokens", args.vocab_size)
        result["in_memory_text_path"] = in_child("inmemory", mem)
        result["train_memory_mb"] = in_child("train-memory", tmp / "tokens", args.vocab_size)
        result["steps"] = in_child("steps", tmp / "tokens", args.vocab_size, args.steps, args.rounds)
        result["load_average_1min_at_end"] = os.getloadavg()[0]  # the machine is shared: how busy it was
        return result
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def timed_rerun(corpus: Path, out: Path, vocab: int) -> float:
    """A second prepare of the same corpus: hashes the corpus, finds it prepared, does nothing else."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lab", "prepare-text", "--corpus", str(corpus), "--out", str(out),
                    "--vocab-size", str(vocab), "--val-fraction", "0.01"], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=500.0)
    p.add_argument("--inmemory-mb", type=float, default=20.0, help="corpus size for the in-memory path (default 20)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/benchmarks/tokens.json")
    p.add_argument("--keep", action="store_true", help="keep the corpus and the token folders under /tmp")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, *rest = args.child
        params = [int(a) if a.isdigit() else a for a in rest]
        print(json.dumps(CHILDREN[name](*params)))
        return
    result = run(args)
    files.atomic_write_json(REPO / args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""`python -m lab prepare-text`: a text corpus tokenized once into memory-mapped token files for data name tokens
(lab/data/tokens.py)."""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("prepare-text", help="tokenize a text corpus once into memory-mapped token files "
                                            "(train.bin, val.bin, tokenizer.json, meta.json) for data name tokens")
    p.add_argument("--corpus", required=True, help="a .txt file (blank-line separated documents) or a folder of them")
    p.add_argument("--out", required=True, help="folder to write (resumes an interrupted preparation there)")
    p.add_argument("--tokenizer", choices=["bpe"], default="bpe",
                   help="a byte-level BPE trained on the corpus's first --sample-mb MB (default)")
    p.add_argument("--vocab-size", type=int, default=50257, help="BPE vocabulary, special token included "
                   "(default 50257, GPT-2's)")
    p.add_argument("--sample-mb", type=float, default=64.0, help="MB of the corpus the BPE is trained on (default 64)")
    p.add_argument("--gpt2-files", metavar="DIR", default=None,
                   help="use GPT-2's own tokenizer from DIR/vocab.json and DIR/merges.txt instead of training one")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents in val (default 0.01)")
    p.add_argument("--force", action="store_true", help="replace tokens prepared from another corpus or tokenizer")
    p.set_defaults(handler=main)


def main(args) -> int:
    """`prepare-text`: 0 when the folder is prepared (or already was), 2 on bad input (one line on stderr)."""
    from lab.core import lock
    from lab.data.tokens import TokenDataError, prepare
    if args.gpt2_files is None and args.vocab_size < 257:
        print(f"error: --vocab-size {args.vocab_size}: a byte-level BPE needs more than 256 tokens", file=sys.stderr)
        return 2
    try:
        meta = prepare(args.corpus, args.out, vocab_size=args.vocab_size, gpt2_files=args.gpt2_files,
                       val_fraction=args.val_fraction, sample_mb=args.sample_mb, force=args.force,
                       log=lambda msg: print(msg, file=sys.stderr))
    except (TokenDataError, lock.StudyLocked) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written: named, not a traceback
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(json.dumps({k: meta[k] for k in ("status", "train_tokens", "val_tokens", "vocab_size", "dtype")}))
    return 0

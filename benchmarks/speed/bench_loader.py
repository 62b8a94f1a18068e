"""The ImageNet loader's throughput on a synthetic JPEG folder: images per second that reach the
device, normalised there, through the lab's own loader (uint8 out of the workers, pinned memory on CUDA).

    python benchmarks/speed/bench_loader.py [--device cuda] [--images 2048] [--workers 8] [--size 224] --out loader.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.data.datasets import load_data, make_loader  # noqa: E402


def synthetic_imagenet(root: Path, images: int, classes: int = 4, side: tuple = (500, 375)) -> Path:
    """train/ and val/ of random JPEGs at ImageNet's typical size, ``images`` in train."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", images), ("val", max(classes, images // 8))):
        for i in range(n):
            folder = root / split / f"c{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (side[1], side[0], 3), dtype=np.uint8)).save(
                folder / f"{i}.jpg", quality=90)
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        root = synthetic_imagenet(Path(tmp), args.images)
        written = time.perf_counter() - t0
        bundle = load_data("imagenet", path=str(root), image_size=args.size)
        loader = make_loader(bundle.train, args.batch, shuffle=True, seed=0, drop_last=True,
                             num_workers=args.workers, pin_memory=args.device == "cuda")
        seen, start = 0, None
        for i, (x, y) in enumerate(loader):
            x = bundle.prepare(x.to(args.device, non_blocking=True))
            y = y.to(args.device, non_blocking=True)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i == 0:  # workers started, first batch in: the clock starts
                start = time.perf_counter()
                continue
            seen += y.numel()
        elapsed = time.perf_counter() - start if start else 0.0
    report = {"device": args.device, "images": args.images, "workers": args.workers, "size": args.size,
              "batch": args.batch, "batch_dtype_from_workers": "uint8", "pinned": args.device == "cuda",
              "images_per_s": seen / elapsed if elapsed else None, "timed_images": seen,
              "jpeg_write_s": written}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

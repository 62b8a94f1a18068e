"""Datasets for the loss-scaling experiments.

``load_data(name, path)`` returns a :class:`DataBundle` (train/val datasets plus
the facts a model needs: number of classes and input channels). Every problem
with the data on disk is raised here as a :class:`DataError`, so a bad path
fails before any training starts rather than halfway through an epoch.

Datasets:

* ``digits``  - scikit-learn's bundled handwritten digits (no download, no path).
* ``cifar10`` - the official "python version" batches, read from a local folder.
* ``imagenet`` - a local ``train/`` + ``val/`` folder in ImageFolder layout.
* ``pydoc``   - Python's own documentation as word tokens, for the language model (lab/data/text.py).
* ``text``    - a local ``.txt`` file or folder of them, for the language model (lab/data/text.py).
* ``tokens``  - a folder made by ``python -m lab prepare-text``: BPE token files, memory-mapped (lab/data/tokens.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from lab.core import files
from lab.data import safe_pickle
from lab.data.bundle import DataBundle, DataError  # the rest of the lab imports both from datasets

AVAILABLE = ("digits", "digits-vqa", "cifar10", "imagenet", "pydoc", "text", "tokens")
TEXT_DATA = ("pydoc", "text")

MIN_IMAGE_SIZE = 8

CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_VAL_FILE = "test_batch"
# The commonly used per-channel statistics of the CIFAR-10 training set.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_data(
    name: str,
    path: str | None = None,
    image_size: int = 32,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    context: int = 64,
    vocab_size: int = 4096,
    part: str | None = None,
) -> DataBundle:
    """Load dataset ``name`` and return its train/val split.

    ``val_fraction`` and ``split_seed`` apply to ``digits`` and the text sets: cifar10 and
    imagenet come with their own fixed validation sets and ignore them.
    """
    if name not in AVAILABLE:
        raise DataError(f"unknown dataset {name!r}; available: {', '.join(AVAILABLE)}")
    if part is not None and name not in TEXT_DATA:
        raise DataError(f"data.part ({part!r}) splits a text corpus (pydoc, text) in two; {name!r} has no parts")
    if name in TEXT_DATA:
        return _load_text(name, path, context, vocab_size, val_fraction, split_seed, part)
    if name == "tokens":  # memory-mapped token files (python -m lab prepare-text)
        from lab.data.tokens import load_bundle
        return load_bundle(path, context, vocab_size)
    # bool is an int subclass; reject it so image_size=True is not read as 1.
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < MIN_IMAGE_SIZE:
        raise DataError(f"image_size must be an integer >= {MIN_IMAGE_SIZE}, got {image_size!r}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction!r}")

    if name in ("digits", "digits-vqa"):
        if path is not None:
            # Refuse rather than ignore: a path here means the caller expected
            # to read their own files and would silently get the bundled set.
            raise DataError(f"digits is bundled with scikit-learn and takes no path, got {path!r}")
        if name == "digits-vqa":  # the multimodal family's questions about the digits (lab/data/vqa.py)
            from lab.data.vqa import digit_questions
            return digit_questions(_load_digits(image_size, val_fraction, split_seed))
        return _load_digits(image_size, val_fraction, split_seed)

    if path is None:
        raise DataError(f"dataset {name!r} needs a path to its local files, got path=None")
    root = Path(path)
    if not root.exists():
        raise DataError(f"{name} data path {root}: expected a folder; found nothing there (it does not exist)")
    if not root.is_dir():
        raise DataError(f"{name} data path {root}: expected a folder; found a file")
    check_readable(name, root)
    if name == "cifar10":
        return _load_cifar10(root, image_size)
    return _load_imagenet(root, image_size)


def check_readable(name: str, path: Path) -> None:
    """A data path this user cannot read (or, for a folder, list) is refused by name, not met halfway."""
    need = os.R_OK | (os.X_OK if path.is_dir() else 0)
    if not files.can_access(path, need):
        kind = "folder" if path.is_dir() else "file"
        raise DataError(f"{name} data path {path}: expected a {kind} this user can read; found one it cannot "
                        f"(mode {path.stat().st_mode & 0o777:o})")


def _listing(folder: Path, limit: int = 5) -> str:
    """'an empty folder' or 'a, b, c, ...': what a folder holds, for an error message."""
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "an empty folder"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def _load_text(name, path, context, vocab_size, val_fraction, split_seed, part=None) -> DataBundle:
    from lab.data.text import TextDataError, corpus_provenance, load_text
    if name == "pydoc" and path is not None:
        raise DataError(f"pydoc ships with Python and takes no path, got {path!r}")
    if name == "text" and path is None:
        raise DataError("dataset 'text' needs a path to a .txt file or a folder of them, got path=None")
    try:
        train, val, vocab, desc = load_text(name, path, context, vocab_size, val_fraction, split_seed, part)
    except TextDataError as e:
        raise DataError(str(e)) from None
    return DataBundle(train, val, num_classes=len(vocab), in_chans=0, name=name, description=desc,
                      input_size=context, task="lm", provenance=corpus_provenance(name, path))


class ResumableRandomSampler(RandomSampler):
    """RandomSampler (the same draws from the same generator, so the same order) that can pass over the first
    ``skip_next`` samples of its next epoch without loading them: a resumed run continues mid-epoch at once.

    Distributed (``world`` > 1): every rank draws the same order and yields its own contiguous share of each
    global batch of ``global_batch`` samples (full global batches only), so the ranks' shares of batch b are
    exactly a single process's batch b (lab/run/distributed.py)."""

    skip_next = 0

    def __init__(self, data_source, generator=None, rank: int = 0, world: int = 1, global_batch: int = 1):
        super().__init__(data_source, generator=generator)
        self.rank, self.world, self.global_batch = rank, world, global_batch

    def __len__(self):
        if self.world == 1:
            return super().__len__()
        return len(self.data_source) // self.global_batch * (self.global_batch // self.world)

    def __iter__(self):
        # lazily: the generator draws exactly when a single process's RandomSampler would
        order = super().__iter__()
        skip, self.skip_next = self.skip_next, 0
        for _ in itertools.islice(order, skip):
            pass
        if self.world == 1:
            yield from order
            return
        share = self.global_batch // self.world
        while len(batch := list(itertools.islice(order, self.global_batch))) == self.global_batch:
            yield from batch[self.rank * share:(self.rank + 1) * share]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool = False,
    num_workers: int = 0,
    rank: int = 0,
    world: int = 1,
    pin_memory: bool = False,
    persistent_workers: bool = False,
) -> DataLoader:
    """A DataLoader whose batch order depends only on ``seed``.

    The generator drives the shuffle and also seeds the worker processes, so
    with ``num_workers > 0`` the random augmentations are reproducible too.
    With ``num_workers == 0`` augmentations draw from torch's global RNG. ``batch_size`` is per process;
    with ``world`` > 1 each rank gets its share of every global batch (ResumableRandomSampler). ``pin_memory``
    for a GPU (a batch's copy overlaps compute); ``persistent_workers`` where no augmentation draws (the
    validation set): a training loader's workers start each epoch again, because their random draws must restart
    from the loader's generator for a resumed run to see the batches an uninterrupted one saw.
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableRandomSampler(dataset, generator=generator, rank=rank, world=world,
                                       global_batch=batch_size * world) if shuffle else None,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        generator=generator,
    )


# --------------------------------------------------------------------- digits


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits file, read as `sklearn.datasets.load_digits` reads it.

    Read directly from the installed package: importing scikit-learn costs 1-3 s per training job,
    a sizeable share of a CPU-sized run. tests/test_data.py checks equality with load_digits().
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set ships with scikit-learn, which is not installed")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"scikit-learn's digits file {path} is missing")
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def _load_digits(image_size: int, val_fraction: float, split_seed: int) -> DataBundle:
    images_u8, labels = _read_digits()
    train_idx, val_idx = _stratified_split(labels, val_fraction, split_seed)

    # 0..16 grey levels -> [0, 1], then upsample once here instead of per batch.
    images = torch.from_numpy(images_u8.astype(np.float32) / 16.0).unsqueeze(1)
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)

    train_x = images[torch.from_numpy(train_idx)]
    val_x = images[torch.from_numpy(val_idx)]
    # Statistics from the training split only, so validation stays unseen.
    mean = train_x.mean()
    std = train_x.std()
    train_x = ((train_x - mean) / std).contiguous()
    val_x = ((val_x - mean) / std).contiguous()

    targets = torch.from_numpy(labels)
    return DataBundle(
        train=TensorDataset(train_x, targets[torch.from_numpy(train_idx)]),
        val=TensorDataset(val_x, targets[torch.from_numpy(val_idx)]),
        num_classes=10,
        in_chans=1,
        name="digits",
        input_size=image_size,
        description=(
            f"sklearn digits {len(train_idx)}/{len(val_idx)} split (seed {split_seed}) "
            f"upsampled 8->{image_size} px"
        ),
    )


def _stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split indices so each class keeps its share in validation.

    Uses its own ``RandomState`` (stable across numpy versions and machines),
    never global random state. The validation size is ceil(fraction * n), as in
    scikit-learn's ``train_test_split``; it is shared out over the classes by
    largest remainder so the total is exact.
    """
    n = len(labels)
    n_val = math.ceil(val_fraction * n)
    if not 0 < n_val < n:
        raise DataError(f"val_fraction={val_fraction!r} leaves an empty split of {n} samples")

    classes, counts = np.unique(labels, return_counts=True)
    wanted = counts * (n_val / n)
    per_class = np.floor(wanted).astype(np.int64)
    # Stable sort: ties in the remainder go to the lower class label.
    by_remainder = np.argsort(-(wanted - per_class), kind="stable")
    per_class[by_remainder[: n_val - per_class.sum()]] += 1

    rng = np.random.RandomState(seed)
    train_parts, val_parts = [], []
    for cls, k in zip(classes, per_class):
        members = rng.permutation(np.flatnonzero(labels == cls))
        val_parts.append(members[:k])
        train_parts.append(members[k:])
    # Sorted so the datasets are in a fixed order; the loader does the shuffling.
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(val_parts))


# -------------------------------------------------------------------- cifar10


class _UInt8ImageDataset(Dataset):
    """Images kept as uint8 (4x smaller than float32) and converted per item.

    CIFAR-10's training set is 150 MB as uint8 but 600 MB as float32, more at
    larger image sizes, so the conversion happens when a sample is read.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, image_size: int, mean, std):
        self.images = images  # N x C x H x W, uint8
        self.labels = labels  # N, int64
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index].float().div_(255.0)
        if image.shape[-1] != self.image_size:
            # antialias only matters when shrinking; it avoids aliasing artefacts.
            image = F.interpolate(
                image.unsqueeze(0),
                size=(self.image_size, self.image_size),
                mode="bilinear",
                align_corners=False,
                antialias=self.image_size < image.shape[-1],
            ).squeeze(0)
        return (image - self.mean) / self.std, self.labels[index]


def _find_cifar10_dir(root: Path) -> Path:
    # Accept the batch folder itself or the folder that contains it.
    if (root / CIFAR10_TRAIN_FILES[0]).exists() or root.name == CIFAR10_DIRNAME:
        return root
    if (root / CIFAR10_DIRNAME).is_dir():
        return root / CIFAR10_DIRNAME
    raise DataError(
        f"cifar10 path {root}: expected a '{CIFAR10_DIRNAME}' folder (with "
        f"{', '.join(CIFAR10_TRAIN_FILES)}, {CIFAR10_VAL_FILE}) or a folder containing one; found {_listing(root)}"
    )


def _read_cifar10_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    if not file.is_file():
        raise DataError(f"cifar10 batch file {file}: expected a file; found nothing there (it is missing)")
    try:
        with open(file, "rb") as handle:
            batch = safe_pickle.load_batch(handle)  # a pickle: only the types a batch holds (no code runs)
    except OSError as error:
        raise DataError(f"cifar10 batch file {file}: expected a readable file; found one that cannot be read "
                        f"({error.strerror})") from None
    except safe_pickle.ForbiddenGlobal as error:
        raise DataError(f"cifar10 batch file {file}: expected a pickled CIFAR-10 batch (bytes, lists, numbers, a "
                        f"NumPy array); found one that needs {error.name}, refused before it could run") from None
    except Exception as error:  # unpickling can fail in many ways on a bad file
        why = " ".join(str(error).split()) or "no message"
        truncated = isinstance(error, EOFError) or "truncated" in why
        raise DataError(f"cifar10 batch file {file}: expected a pickled CIFAR-10 batch; found "
                        f"{'a truncated file' if truncated else 'a file that does not unpickle'} of "
                        f"{file.stat().st_size} bytes ({type(error).__name__}: {why})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"cifar10 batch file {file} must be a dict with keys b'data' and b'labels'")

    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"cifar10 batch file {file}: b'data' must be N x 3072 uint8, got {data.shape} {data.dtype}"
        )
    if labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"cifar10 batch file {file}: b'labels' must be {len(data)} integers, got shape {labels.shape}"
        )
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"cifar10 batch file {file}: labels must be in 0..9")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _load_cifar10(root: Path, image_size: int) -> DataBundle:
    folder = _find_cifar10_dir(root)
    # Check every file exists before reading any, so the error comes quickly.
    for file_name in (*CIFAR10_TRAIN_FILES, CIFAR10_VAL_FILE):
        if not (folder / file_name).is_file():
            raise DataError(f"cifar10 batch file {folder / file_name}: expected a file; found nothing there "
                            f"(it is missing)")

    train_batches = [_read_cifar10_batch(folder / f) for f in CIFAR10_TRAIN_FILES]
    train_x = torch.from_numpy(np.concatenate([x for x, _ in train_batches]))
    train_y = torch.from_numpy(np.concatenate([y for _, y in train_batches]))
    val_x, val_y = (torch.from_numpy(a) for a in _read_cifar10_batch(folder / CIFAR10_VAL_FILE))
    # batches.meta (label names) is optional and not needed: labels are 0..9.

    return DataBundle(
        train=_UInt8ImageDataset(train_x, train_y, image_size, CIFAR10_MEAN, CIFAR10_STD),
        val=_UInt8ImageDataset(val_x, val_y, image_size, CIFAR10_MEAN, CIFAR10_STD),
        num_classes=10,
        in_chans=3,
        name="cifar10",
        input_size=image_size,
        description=f"cifar10 {len(train_y)}/{len(val_y)} from {folder} at {image_size} px",
    )


# ------------------------------------------------------------------- imagenet


def _image_folder(folder: Path, transform):
    from torchvision.datasets import ImageFolder

    if not folder.is_dir():
        raise DataError(f"imagenet folder {folder}: expected a class-per-folder directory; found "
                        f"{'a file' if folder.exists() else 'nothing there'}")
    try:
        dataset = ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as error:
        # torchvision raises this for no class folders or a class with no images.
        raise DataError(f"imagenet folder {folder}: expected class folders holding images; found none usable "
                        f"({' '.join(str(error).split())})") from None
    except PermissionError as error:
        raise DataError(f"imagenet folder {folder}: expected folders this user can read; found "
                        f"{error.filename or folder} unreadable ({error.strerror})") from None
    paths = [path for path, _ in dataset.samples]
    marker = _checked_marker(folder, paths)
    if marker is None or not marker.exists():
        check_images(paths)
        if marker is not None:
            with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run the check
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(f"{folder.resolve()}: {len(paths)} image headers checked\n")
    return dataset


def _checked_marker(folder: Path, paths: list[str]) -> Path | None:
    """Where a check of this tree's image headers is remembered, so that each run does not reopen 1.3 M of them:
    named by the folder, every image's path and each class folder's modification time (which a file added,
    removed or renamed there changes). $LAB_CACHE_DIR, else ~/.cache/loss-scale-lab; None without a home."""
    root = os.environ.get("LAB_CACHE_DIR") or (os.path.join(os.path.expanduser("~"), ".cache", "loss-scale-lab")
                                               if os.path.expanduser("~") != "~" else None)
    if root is None:
        return None
    key = hashlib.sha256(str(folder.resolve()).encode())
    for path in paths:
        key.update(path.encode() + b"\0")
    for d in sorted({os.path.dirname(p) for p in paths}):
        key.update(str(os.stat(d).st_mtime_ns).encode())
    return Path(root) / "checked-images" / key.hexdigest()


def check_images(paths: list[str]) -> None:
    """Open every image's header (no decoding), so a file that is not an image, or cannot be read, is refused
    before training starts instead of ending the run at the batch that holds it. A damaged body behind a valid
    header is found only when the image is decoded."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def problem(path: str) -> str | None:
        try:
            with Image.open(path) as image:
                image.size  # noqa: B018 (the header is parsed by open)
        except Exception as error:  # PIL's UnidentifiedImageError is an OSError, so is a permission error
            size = os.stat(path).st_size if os.path.exists(path) else 0
            if type(error).__name__ == "UnidentifiedImageError":
                what = f"a file of {size} bytes that PIL cannot identify as an image"
            elif isinstance(error, OSError):
                what = f"a file that cannot be read ({error.strerror or error})"
            else:
                what = f"a file PIL refuses ({type(error).__name__}: {' '.join(str(error).split())})"
            return f"image file {path}: expected an image (JPEG, PNG, ...); found {what}"
        return None

    def first_problem(chunk: list[str]) -> str | None:
        return next(filter(None, map(problem, chunk)), None)

    chunks = [paths[i:i + 1024] for i in range(0, len(paths), 1024)]
    if len(chunks) <= 2:
        first = next(filter(None, map(first_problem, chunks)), None)
    else:  # an ImageNet-sized tree: the file opens overlap
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            first = next(filter(None, pool.map(first_problem, chunks)), None)
            pool.shutdown(cancel_futures=True)
    if first:
        raise DataError(first)


def _load_imagenet(root: Path, image_size: int) -> DataBundle:
    from torchvision import transforms

    # uint8 out of the workers (a quarter of float32's bytes through pinned memory to the GPU), normalised on the
    # device (DataBundle.prepare); ImageFolder's loader has made every image RGB
    to_uint8 = [transforms.PILToTensor()]
    train_transform = transforms.Compose(
        [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), *to_uint8])
    # The usual 224/256 centre-crop ratio, scaled to image_size.
    val_transform = transforms.Compose(
        [transforms.Resize(int(image_size * 256 / 224)), transforms.CenterCrop(image_size), *to_uint8])
    train = _image_folder(root / "train", train_transform)
    val = _image_folder(root / "val", val_transform)
    # Label i must mean the same class in both splits.
    if val.classes != train.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise DataError(
            f"imagenet class folders differ between {root / 'train'} and {root / 'val'}: "
            f"only in train {only_train[:5]}, only in val {only_val[:5]}"
        )
    return DataBundle(
        train=train,
        val=val,
        num_classes=len(train.classes),
        in_chans=3,
        name="imagenet",
        input_size=image_size,
        normalize_on_device=(IMAGENET_MEAN, IMAGENET_STD),
        description=(
            f"imagenet-style folder {root}: {len(train)}/{len(val)} images, "
            f"{len(train.classes)} classes at {image_size} px"
        ),
    )

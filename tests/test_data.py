"""Tests for lab/data/datasets.py.

cifar10 and imagenet are tested on tiny datasets written here in the real
on-disk formats, so no download is needed.
"""

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# Let plain `pytest` find the `lab` package without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.data.datasets import AVAILABLE, DataBundle, DataError, load_data, make_loader  # noqa: E402

torch.set_num_threads(1)


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return load_data("digits")


def _labels(dataset):
    return dataset.tensors[1]


def test_digits_shapes_and_metadata(digits):
    assert isinstance(digits, DataBundle)
    assert digits.name == "digits"
    assert digits.num_classes == 10
    assert digits.in_chans == 1
    train_x, train_y = digits.train.tensors
    val_x, val_y = digits.val.tensors
    assert train_x.shape[1:] == (1, 32, 32)
    assert val_x.shape[1:] == (1, 32, 32)
    assert train_x.dtype == torch.float32 and val_x.dtype == torch.float32
    assert train_y.dtype == torch.int64
    assert set(train_y.tolist()) == set(range(10))
    assert set(val_y.tolist()) == set(range(10))
    assert str(len(train_y)) in digits.description and str(len(val_y)) in digits.description


def test_digits_split_sizes(digits):
    n_train, n_val = len(digits.train), len(digits.val)
    assert n_train + n_val == 1797
    # 20% of 1797 is 359.4; allow either rounding.
    assert n_val in (359, 360)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_digits_split_follows_val_fraction(fraction):
    bundle = load_data("digits", image_size=8, val_fraction=fraction)
    assert abs(len(bundle.val) - fraction * 1797) <= 1
    assert len(bundle.train) + len(bundle.val) == 1797


def test_digits_image_size(digits):
    small = load_data("digits", image_size=8)
    big = load_data("digits", image_size=48)
    assert small.train.tensors[0].shape[1:] == (1, 8, 8)
    assert big.train.tensors[0].shape[1:] == (1, 48, 48)
    # Resizing must not change which samples go where.
    assert torch.equal(_labels(small.train), _labels(digits.train))


def _raw_digits():
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.images.reshape(len(raw.images), -1), raw.target


def test_digits_at_native_size_are_the_sklearn_images():
    # At 8 px there is no interpolation: undoing the normalisation must give
    # back rows of sklearn's data, with their own labels, each used once.
    bundle = load_data("digits", image_size=8)
    raw_x, raw_y = _raw_digits()
    images = torch.cat([bundle.train.tensors[0], bundle.val.tensors[0]]).flatten(1).numpy()
    labels = torch.cat([_labels(bundle.train), _labels(bundle.val)]).numpy()
    # The smallest pixel value in a training split is 0, the largest 16;
    # use that to invert the affine normalisation.
    lo, hi = images.min(), images.max()
    pixels = np.rint((images - lo) / (hi - lo) * 16).astype(int)
    lookup = {row.tobytes(): [] for row in raw_x.astype(int)}
    for row, label in zip(raw_x.astype(int), raw_y):
        lookup[row.tobytes()].append(label)
    for row, label in zip(pixels, labels):
        assert label in lookup[row.tobytes()]
    assert sorted(labels.tolist()) == sorted(raw_y.tolist())


def test_digits_same_seed_is_identical(digits):
    again = load_data("digits")
    for a, b in ((digits.train, again.train), (digits.val, again.val)):
        assert torch.equal(a.tensors[0], b.tensors[0])
        assert torch.equal(a.tensors[1], b.tensors[1])


def test_digits_different_seed_changes_split(digits):
    other = load_data("digits", split_seed=1)
    assert len(other.val) == len(digits.val)
    assert not torch.equal(other.val.tensors[0], digits.val.tensors[0])


def _row_keys(bundle, split):
    # Identify samples by their pixels at native size (the split is the same
    # at every image size, and native size has no interpolation).
    x = getattr(bundle, split).tensors[0].flatten(1).numpy()
    return {row.round(4).tobytes() for row in x}


def test_digits_train_and_val_do_not_overlap():
    bundle = load_data("digits", image_size=8)
    raw_x, _ = _raw_digits()
    # Duplicate images in the raw data could create overlap that is not a bug.
    n_unique_raw = len({row.tobytes() for row in raw_x})
    train_keys, val_keys = _row_keys(bundle, "train"), _row_keys(bundle, "val")
    assert len(train_keys) + len(val_keys) >= n_unique_raw
    assert len(train_keys & val_keys) <= 1797 - n_unique_raw


def test_digits_split_is_stratified(digits):
    _, raw_y = _raw_digits()
    overall = np.bincount(raw_y, minlength=10) / len(raw_y)
    for dataset in (digits.train, digits.val):
        share = np.bincount(_labels(dataset).numpy(), minlength=10) / len(dataset)
        # A random unstratified 360-sample split deviates by several points.
        assert np.abs(share - overall).max() < 0.005


def test_digits_normalised_with_training_stats(digits):
    train_x, val_x = digits.train.tensors[0], digits.val.tensors[0]
    assert abs(train_x.mean().item()) < 1e-4
    assert abs(train_x.std().item() - 1.0) < 1e-4
    # Validation uses the training statistics, so it is close but not exact.
    assert abs(val_x.mean().item()) < 0.1
    assert abs(val_x.mean().item()) > 1e-6


# --------------------------------------------------------------- cifar10


def _write_batch(file, n, rng, label_offset=0):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [(i + label_offset) % 10 for i in range(n)]
    with open(file, "wb") as handle:
        pickle.dump({b"batch_label": b"x", b"data": data, b"labels": labels, b"filenames": []}, handle)
    return data, labels


@pytest.fixture
def cifar_root(tmp_path):
    """A tiny cifar-10-batches-py folder: 5 train batches of 4, a test batch of 3."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    written = {}
    for i in range(1, 6):
        written[f"data_batch_{i}"] = _write_batch(folder / f"data_batch_{i}", 4, rng, label_offset=i)
    written["test_batch"] = _write_batch(folder / "test_batch", 3, rng)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, handle)
    return folder, written


@pytest.mark.parametrize("use_parent", [False, True])
def test_cifar10_loads_folder_or_parent(cifar_root, use_parent):
    folder, written = cifar_root
    bundle = load_data("cifar10", path=str(folder.parent if use_parent else folder))
    assert bundle.name == "cifar10"
    assert bundle.num_classes == 10
    assert bundle.in_chans == 3
    assert len(bundle.train) == 20
    assert len(bundle.val) == 3
    image, label = bundle.train[0]
    assert image.shape == (3, 32, 32)
    assert image.dtype == torch.float32
    train_labels = [int(bundle.train[i][1]) for i in range(20)]
    expected = [label for i in range(1, 6) for label in written[f"data_batch_{i}"][1]]
    assert train_labels == expected
    assert [int(bundle.val[i][1]) for i in range(3)] == written["test_batch"][1]


def test_cifar10_pixels_are_chw_and_normalised(cifar_root):
    folder, written = cifar_root
    bundle = load_data("cifar10", path=str(folder))
    raw = written["test_batch"][0][1]  # second test image, flat CHW uint8
    image, _ = bundle.val[1]
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    restored = (image * std + mean) * 255
    expected = torch.from_numpy(raw.astype(np.float32)).view(3, 32, 32)
    assert torch.allclose(restored, expected, atol=1e-3)


def test_cifar10_resizes(cifar_root):
    folder, _ = cifar_root
    bundle = load_data("cifar10", path=str(folder), image_size=16)
    assert bundle.train[0][0].shape == (3, 16, 16)
    assert bundle.val[0][0].shape == (3, 16, 16)


def test_cifar10_batches_meta_is_optional(cifar_root):
    folder, _ = cifar_root
    (folder / "batches.meta").unlink()
    assert len(load_data("cifar10", path=str(folder)).train) == 20


def test_cifar10_works_with_make_loader(cifar_root):
    folder, _ = cifar_root
    bundle = load_data("cifar10", path=str(folder))
    images, labels = next(iter(make_loader(bundle.train, batch_size=8, shuffle=True, seed=0)))
    assert images.shape == (8, 3, 32, 32)
    assert labels.shape == (8,)


def test_cifar10_missing_batch_file(cifar_root):
    folder, _ = cifar_root
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3") as info:
        load_data("cifar10", path=str(folder))
    assert str(folder / "data_batch_3") in str(info.value)


def test_cifar10_missing_test_batch(cifar_root):
    folder, _ = cifar_root
    (folder / "test_batch").unlink()
    with pytest.raises(DataError) as info:
        load_data("cifar10", path=str(folder.parent))
    assert str(folder / "test_batch") in str(info.value)


def test_cifar10_folder_without_batches(tmp_path):
    with pytest.raises(DataError) as info:
        load_data("cifar10", path=str(tmp_path))
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        {b"labels": [0, 1]},  # no b"data"
        {b"data": np.zeros((2, 3072), np.uint8)},  # no b"labels"
        {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]},  # str keys
        {b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]},  # wrong width
        {b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]},  # wrong dtype
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]},  # count mismatch
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]},  # label out of range
        [1, 2, 3],  # not a dict
    ],
)
def test_cifar10_malformed_batch(cifar_root, content):
    folder, _ = cifar_root
    with open(folder / "data_batch_2", "wb") as handle:
        pickle.dump(content, handle)
    with pytest.raises(DataError) as info:
        load_data("cifar10", path=str(folder))
    assert str(folder / "data_batch_2") in str(info.value)


def test_cifar10_unreadable_pickle(cifar_root):
    folder, _ = cifar_root
    (folder / "test_batch").write_bytes(b"this is not a pickle")
    with pytest.raises(DataError) as info:
        load_data("cifar10", path=str(folder))
    assert str(folder / "test_batch") in str(info.value)


# -------------------------------------------------------------- imagenet


def _write_images(folder, count, size, colour, ext):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", size, colour).save(folder / f"img{i}.{ext}")


@pytest.fixture
def imagenet_root(tmp_path):
    """train/ with 3 classes (2, 3, 1 images), val/ with the same classes."""
    root = tmp_path / "imagenet"
    layout = {"ant": (2, 1), "bee": (3, 1), "cat": (1, 2)}
    for k, (name, (n_train, n_val)) in enumerate(layout.items()):
        colour = (80 * k, 40, 200 - 60 * k)
        _write_images(root / "train" / name, n_train, (40, 30), colour, "png")
        _write_images(root / "val" / name, n_val, (30, 50), colour, "jpg")
    return root


def test_imagenet_loads(imagenet_root):
    bundle = load_data("imagenet", path=str(imagenet_root), image_size=16)
    assert bundle.name == "imagenet"
    assert bundle.num_classes == 3
    assert bundle.in_chans == 3
    assert len(bundle.train) == 6
    assert len(bundle.val) == 4
    assert sorted(label for _, label in bundle.train.samples) == [0, 0, 1, 1, 1, 2]
    assert sorted(label for _, label in bundle.val.samples) == [0, 1, 2, 2]
    for dataset in (bundle.train, bundle.val):
        image, label = dataset[0]
        assert image.shape == (3, 16, 16)
        assert image.dtype == torch.uint8  # a quarter of float32's bytes to the GPU; normalised there
    image, label = bundle.val[0]
    assert label == 0
    x = bundle.prepare(image.unsqueeze(0))[0]
    # the reference: torchvision's ToTensor and Normalize on the same pixels
    from torchvision import transforms
    ref = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))(
        transforms.ToTensor()(transforms.functional.to_pil_image(image)))
    assert x.dtype == torch.float32 and torch.allclose(x, ref, atol=1e-6)
    # Solid-colour images: the red channel of class "ant" (red 0) is -mean/std everywhere.
    assert torch.allclose(x[0], torch.full((16, 16), -0.485 / 0.229), atol=0.05)


def test_imagenet_headers_are_checked_once_per_tree(imagenet_root, tmp_path, monkeypatch):
    """check_images opens every header (1.3 M for ImageNet): once per tree, remembered in $LAB_CACHE_DIR; again
    when a class folder changes; a bad image is still refused."""
    import lab.data.datasets as datasets
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "cache"))
    checked = []
    real = datasets.check_images
    monkeypatch.setattr(datasets, "check_images", lambda paths: (checked.append(len(paths)), real(paths)))
    load_data("imagenet", path=str(imagenet_root), image_size=16)
    assert checked == [6, 4]
    load_data("imagenet", path=str(imagenet_root), image_size=16)
    assert checked == [6, 4]  # remembered
    (imagenet_root / "val" / "bee" / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match="broken.jpg"):
        load_data("imagenet", path=str(imagenet_root), image_size=16)
    assert checked == [6, 4, 5]  # train's marker holds; val's folder changed, so it is checked again


def test_imagenet_none_path():
    with pytest.raises(DataError, match="path"):
        load_data("imagenet")


def test_imagenet_missing_val(imagenet_root):
    import shutil

    shutil.rmtree(imagenet_root / "val")
    with pytest.raises(DataError) as info:
        load_data("imagenet", path=str(imagenet_root))
    assert str(imagenet_root / "val") in str(info.value)


def test_imagenet_missing_train(imagenet_root):
    import shutil

    shutil.rmtree(imagenet_root / "train")
    with pytest.raises(DataError) as info:
        load_data("imagenet", path=str(imagenet_root))
    assert str(imagenet_root / "train") in str(info.value)


def test_imagenet_class_without_images(imagenet_root):
    (imagenet_root / "train" / "dog").mkdir()
    (imagenet_root / "train" / "dog" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError) as info:
        load_data("imagenet", path=str(imagenet_root))
    assert str(imagenet_root / "train") in str(info.value)


def test_imagenet_train_without_class_folders(tmp_path):
    (tmp_path / "train").mkdir()
    _write_images(tmp_path / "val" / "ant", 1, (20, 20), (0, 0, 0), "png")
    with pytest.raises(DataError) as info:
        load_data("imagenet", path=str(tmp_path))
    assert str(tmp_path / "train") in str(info.value)


def test_imagenet_val_classes_must_match(imagenet_root):
    _write_images(imagenet_root / "val" / "dog", 1, (20, 20), (0, 0, 0), "png")
    with pytest.raises(DataError, match="dog") as info:
        load_data("imagenet", path=str(imagenet_root))
    assert str(imagenet_root / "val") in str(info.value)


# ------------------------------------------------------ argument errors


@pytest.mark.parametrize("name", ["cifar10", "imagenet"])
def test_path_does_not_exist(tmp_path, name):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as info:
        load_data(name, path=str(missing))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("name", ["cifar10", "imagenet"])
def test_path_is_a_file(tmp_path, name):
    file = tmp_path / "data.bin"
    file.write_bytes(b"")
    with pytest.raises(DataError) as info:
        load_data(name, path=str(file))
    assert str(file) in str(info.value)


def test_cifar10_none_path():
    with pytest.raises(DataError, match="cifar10"):
        load_data("cifar10", path=None)


def test_digits_rejects_a_path(tmp_path):
    with pytest.raises(DataError) as info:
        load_data("digits", path=str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_unknown_dataset_lists_available():
    with pytest.raises(DataError) as info:
        load_data("mnist")
    message = str(info.value)
    assert "mnist" in message
    for name in AVAILABLE:
        assert name in message


@pytest.mark.parametrize("size", [7, 0, -32])
def test_image_size_too_small(size):
    with pytest.raises(DataError, match="image_size"):
        load_data("digits", image_size=size)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_val_fraction_out_of_range(fraction):
    with pytest.raises(DataError, match="val_fraction"):
        load_data("digits", val_fraction=fraction)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------- make_loader


def _order(loader):
    return torch.cat([batch[0] for batch in loader]).tolist()


def test_make_loader_order_is_reproducible():
    dataset = torch.utils.data.TensorDataset(torch.arange(100))
    first = _order(make_loader(dataset, batch_size=16, shuffle=True, seed=3))
    second = _order(make_loader(dataset, batch_size=16, shuffle=True, seed=3))
    other = _order(make_loader(dataset, batch_size=16, shuffle=True, seed=4))
    assert first == second
    assert sorted(first) == list(range(100))
    assert first != list(range(100))
    assert other != first


def test_make_loader_without_shuffle_keeps_order():
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    assert _order(make_loader(dataset, batch_size=4, shuffle=False, seed=0)) == list(range(10))


def test_make_loader_options():
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    loader = make_loader(dataset, batch_size=4, shuffle=True, seed=0, drop_last=True)
    assert loader.pin_memory is False
    assert [len(batch[0]) for batch in loader] == [4, 4]


def test_digits_file_reader_matches_sklearn_load_digits():
    from sklearn.datasets import load_digits

    from lab.data.datasets import _read_digits

    images, labels = _read_digits()
    raw = load_digits()
    assert np.array_equal(images, raw.images) and np.array_equal(labels, raw.target)


def test_a_resumed_epoch_skips_used_samples_unread_in_the_same_order():
    """make_loader's order equals DataLoader(shuffle=True)'s for the seed; skip_next passes over a resumed
    epoch's used batches without loading them (lab/run/train.py sets it on resume)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from lab.data.datasets import make_loader

    class Counting(Dataset):
        loaded = 0

        def __len__(self):
            return 100

        def __getitem__(self, i):
            Counting.loaded += 1
            return torch.tensor(i)

    ds = Counting()
    g = torch.Generator().manual_seed(3)
    reference = [b.tolist() for b in DataLoader(ds, batch_size=8, shuffle=True, drop_last=True, generator=g)]
    loader = make_loader(ds, 8, shuffle=True, seed=3, drop_last=True)
    start = loader.generator.get_state()
    assert [b.tolist() for b in loader] == reference
    loader.generator.set_state(start)
    loader.sampler.skip_next = 5 * 8
    Counting.loaded = 0
    assert [b.tolist() for b in loader] == reference[5:]
    assert Counting.loaded == 8 * len(reference[5:])  # the skipped 40 samples were never read
    assert [b.tolist() for b in loader] != reference  # skip_next lasts one epoch; the next epoch is a new order

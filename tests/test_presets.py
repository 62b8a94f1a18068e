"""Every model preset builds with random weights and trains a step; the GPU study config runs end to end
on CPU (tiny ImageFolder data, a few steps), so configs/imagenet.yaml is exercised before it meets a GPU."""
import contextlib
import io
import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from lab import cli
from lab.models.presets import available_presets, create_model
# imported here, at collection, not first by cli.main inside a redirect: train()'s default progress stream is the
# sys.stderr of its first import
from lab.run import train as _train  # noqa: F401

from conftest import REPO

SIZES = {"vit-tiny-digits": 16, "vit_small_patch16": 32}
LANGUAGE_MODELS = ("gpt-tiny", "gpt2-small")
VISION_LANGUAGE = ("vlm-digits",)


FROM_A_FOLDER = ("hf-causal-lm",)  # a model loaded from finetune.base_model (tests/test_lora.py trains one)


def test_a_preset_loaded_from_a_folder_says_so_when_built_alone():
    with pytest.raises(ValueError, match="finetune.base_model"):
        create_model("hf-causal-lm", num_classes=50, in_chans=0, input_size=16)


@pytest.mark.parametrize("preset", [p for p in available_presets() if p not in FROM_A_FOLDER])
def test_preset_builds_and_trains_a_step(preset):
    torch.manual_seed(0)
    if preset in VISION_LANGUAGE:  # an image and a question packed in one row (lab/data/vqa.py)
        model = create_model(preset, num_classes=22, in_chans=1, input_size=16)
        x = torch.cat([torch.randn(2, 16 * 16), torch.randint(0, 22, (2, 4)).float()], dim=1)
        logits, y = model(x), torch.tensor([1, 5])
        assert logits.shape == (2, 22)
    elif preset in LANGUAGE_MODELS:  # num_classes is the vocabulary, input_size the context
        model = create_model(preset, num_classes=50, in_chans=0, input_size=16)
        x, y = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
        logits = model(x)
        assert logits.shape == (2, 16, 50)
        logits, y = logits.flatten(0, 1), y.flatten()
    else:
        size = SIZES.get(preset, 32)
        model = create_model(preset, num_classes=7, in_chans=3, input_size=size)
        x, y = torch.randn(2, 3, size, size), torch.tensor([1, 5])
        logits = model(x)
        assert logits.shape == (2, 7)
    F.cross_entropy(logits, y).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_unknown_preset_lists_available():
    with pytest.raises(ValueError, match="resnet50-digits"):
        create_model("resnet51", num_classes=2, in_chans=3, input_size=32)


def test_imagenet_config_runs_on_cpu(tmp_path):
    data = tmp_path / "imagenet"
    for split in ("train", "val"):
        for c, colour in enumerate(["red", "green", "blue"]):
            folder = data / split / f"n0{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), colour).save(folder / f"img{i}.JPEG")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the lab trains a language model on local text.\n\n" * 20)
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({"device": "cpu", "threads": 1,
                                     "data": {"path": str(data), "image_size": 32, "num_workers": 0},
                                     "models": {"lm": {"data": {"path": str(corpus)}}},
                                     "train": {"batch_size": 4, "max_steps": 2, "epochs": 1, "log_every": 1}}))
    out = tmp_path / "run"
    # `python -m lab train` in this process (lab.cli.main, what lab/__main__.py calls): a subprocess cost ~5 s of
    # importing torch, and the config files are what is tested
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", "--model", "resnet50", "--mode", "fp16-dynamic", "--out", str(out),
                       "--config", str(REPO / "configs" / "imagenet.yaml"), "--config", str(local)])
    assert rc == 0, err.getvalue()[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["preset"] == "resnet50" and metrics["steps"] == 2 and metrics["scaler"] == "dynamic"
    assert "12/12 images, 3 classes at 32 px" in metrics["data"]

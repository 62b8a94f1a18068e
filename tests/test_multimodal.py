"""The multimodal family: its data, its model, its pre-trained encoder, and the source's remedies in the
engine (a branch clipped on its own, empty-gradient steps before training)."""
import copy
import json

import numpy as np
import pytest
import torch
import yaml

from lab.core.config import ConfigError, resolve_run, validate_study
from lab.data.datasets import _read_digits, load_data
from lab.data.vqa import DIGITS, QUESTIONS, VOCAB, answer
from lab.models.multimodal import EncoderError, branch_of, load_encoder
from lab.models.presets import create_model
from lab.run.loop import clip_groups
from lab.run.train import train

from conftest import REPO


def mm_study(tmp_path, **train) -> dict:
    """configs/multimodal.yaml shrunk to seconds, its results under tmp_path."""
    study = yaml.safe_load((REPO / "configs" / "multimodal.yaml").read_text())
    study["results_dir"] = str(tmp_path / "results")
    study["seeds"] = [0]
    study["train"].update(epochs=1, max_steps=3, batch_size=16, log_every=1, census_every=0, **train)
    study["models"]["vit_encoder"]["train"] = {"max_steps": 2, "schedule": "constant"}
    study["models"]["vlm"]["modes"] = ["fp32", "fp16-dynamic"]
    study["models"].pop("lm")
    return validate_study(study)


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    """The encoder's pre-training run (2 steps) that every VLM run of the module loads."""
    tmp = tmp_path_factory.mktemp("mm")
    study = mm_study(tmp)
    run = resolve_run(study, "vit_encoder", "fp32", 0)
    assert run.train.save_weights  # another family names it as its encoder
    train(run, tmp / "results" / "runs" / "vit_encoder" / "fp32" / "seed0", progress=open("/dev/null", "w"))
    return tmp


def test_every_question_has_its_answer_and_an_image_its_four_questions():
    bundle = load_data("digits-vqa", image_size=8, val_fraction=0.2, split_seed=0)
    images, labels = _read_digits()
    for ds in (bundle.train, bundle.val):
        assert len(ds) == 4 * len(ds.images)
        assert (ds.units == np.repeat(np.arange(len(ds.images)), 4)).all()
        for i in range(0, len(ds), 97):
            x, y = ds[i]
            image, q = divmod(i, 4)
            question = " ".join(VOCAB[int(t)] for t in x[-4:])
            assert question == QUESTIONS[q]
            assert VOCAB[int(y)] == answer(int(ds.labels[image]), q)
    assert answer(7, 0) == "seven" and answer(7, 1) == "no" and answer(9, 2) == "zero" and answer(5, 3) == "yes"
    assert answer(4, 3) == "no" and set(DIGITS) <= set(VOCAB) and bundle.num_classes == len(VOCAB)


def test_the_model_reads_back_the_packed_image_and_question():
    bundle = load_data("digits-vqa", image_size=16, val_fraction=0.2, split_seed=0)
    model = create_model("vlm-digits", num_classes=len(VOCAB), in_chans=1, input_size=16)
    x = torch.stack([bundle.val[i][0] for i in range(8)])
    images, question = model.unpack(x)
    assert torch.equal(images.reshape(8, -1), torch.stack([bundle.val.images[i // 4] for i in range(8)]))
    assert torch.equal(question, bundle.val.questions[torch.arange(8) % 4].long())
    assert model(x).shape == (8, len(VOCAB))
    names = [n for n, _ in model.named_parameters()]
    assert {branch_of(n) for n in names} == {"encoder", "projector", "decoder"}
    assert not any(n.startswith(("encoder.head", "encoder.norm.")) for n in names)  # unused: removed


def test_the_encoder_is_the_pretrained_run_and_bad_weights_are_named(encoder_run, tmp_path):
    weights = encoder_run / "results" / "runs" / "vit_encoder" / "fp32" / "seed0" / "weights.pt"
    state = torch.load(weights, weights_only=True)
    model = create_model("vlm-digits", num_classes=len(VOCAB), in_chans=1, input_size=16)
    load_encoder(model, str(weights))
    mine = model.encoder.state_dict()
    assert mine and all(torch.equal(mine[k], state[k]) for k in mine)
    with pytest.raises(EncoderError, match="found nothing there"):
        load_encoder(model, str(tmp_path / "none.pt"))
    torch.save({"patch_embed.proj.weight": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(EncoderError, match="do not fit the encoder"):
        load_encoder(model, str(tmp_path / "bad.pt"))
    with pytest.raises(EncoderError, match="no pre-trained encoder"):
        load_encoder(torch.nn.Linear(2, 2), str(weights))


def test_a_config_names_a_trained_encoder_run(tmp_path):
    study = mm_study(tmp_path)
    bad = copy.deepcopy(study)
    bad["models"]["vlm"]["encoder"] = {"family": "vit_encodr"}
    with pytest.raises(ConfigError, match="vit_encodr.*did you mean"):
        validate_study(bad)
    bad["models"]["vlm"]["encoder"] = {"family": "vit_encoder", "mode": "fp16-dynamic"}
    with pytest.raises(ConfigError, match="encoder.mode: expected one of 'vit_encoder'"):
        validate_study(bad)
    run = resolve_run(study, "vlm", "fp32", 0)
    moved = resolve_run({**study, "results_dir": str(tmp_path / "elsewhere")}, "vlm", "fp32", 0)
    assert run.model.encoder["run"] != moved.model.encoder["run"] and run.hash() == moved.hash()


def test_clip_groups_clips_the_branch_alone(encoder_run):
    study = mm_study(encoder_run)
    model = resolve_run(study, "vlm", "fp32", 0).model.build(len(VOCAB), 1, 16)
    (_, encoder), = clip_groups(model, {"encoder": 1.0})
    assert {id(p) for p in encoder} == {id(p) for n, p in model.named_parameters() if n.startswith("encoder.")}
    with pytest.raises(ValueError, match="'vision' names no trainable parameter.*decoder, encoder, projector"):
        clip_groups(model, {"vision": 1.0})


def test_a_clip_group_naming_no_parameter_is_refused_before_anything_is_written(encoder_run, tmp_path):
    run = resolve_run(mm_study(encoder_run, clip_groups={"vision": 0.5}), "vlm", "fp16-dynamic", 0)
    with pytest.raises(ConfigError, match="'vision' names no trainable parameter"):
        train(run, tmp_path / "run", progress=open("/dev/null", "w"))
    assert not (tmp_path / "run").exists()
    moved = resolve_run(mm_study(tmp_path / "elsewhere"), "vlm", "fp16-dynamic", 0)  # no encoder run there
    with pytest.raises(EncoderError, match="expected the encoder's weights at .*elsewhere"):
        train(moved, tmp_path / "run", progress=open("/dev/null", "w"))
    assert not (tmp_path / "run").exists()


def _norms_at_step(run, out, monkeypatch) -> list[dict]:
    """Each optimizer step's gradient norm per branch, as the optimizer sees them."""
    from lab.run import loop as loop_module
    seen, loops = [], []
    original_step, original_init = torch.optim.AdamW.step, loop_module.EpochLoop.__post_init__

    def post_init(self):
        original_init(self)
        loops.append(self)

    def step(self, *a, **k):
        named = list(loops[-1].model.named_parameters())
        seen.append({b: float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for n, p in named if p.grad is not None and branch_of(n) == b])))
            for b in ("encoder", "decoder")})
        return original_step(self, *a, **k)

    monkeypatch.setattr(loop_module.EpochLoop, "__post_init__", post_init)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    train(run, out, progress=open("/dev/null", "w"))
    monkeypatch.undo()  # the next call wraps the originals, not these
    return seen


def test_the_vision_branch_is_clipped_after_unscaling_and_the_rest_is_not(encoder_run, tmp_path, monkeypatch):
    limit = 1e-4  # below the encoder's gradient norm at every step, so that clipping acts
    plain = _norms_at_step(resolve_run(mm_study(encoder_run), "vlm", "fp16-dynamic", 0), tmp_path / "a", monkeypatch)
    clipped = _norms_at_step(resolve_run(mm_study(encoder_run, clip_groups={"encoder": limit}), "vlm",
                                         "fp16-dynamic", 0), tmp_path / "b", monkeypatch)
    assert all(s["encoder"] > limit for s in plain), plain
    assert all(s["encoder"] <= limit * (1 + 1e-5) for s in clipped)
    # the decoder's gradients at step 0 (same weights, same batch) are untouched
    assert clipped[0]["decoder"] == pytest.approx(plain[0]["decoder"], rel=1e-6)


def test_empty_gradient_steps_move_the_scale_and_nothing_else(encoder_run, tmp_path, monkeypatch):
    from lab.core import config as config_module
    build = config_module.ModelConfig.build

    def with_dropout(self, *a, **k):  # a model that draws from torch's generator in every training forward
        model = build(self, *a, **k)
        for block in model.decoder.blocks:
            block.drop.p = 0.3
        return model

    monkeypatch.setattr(config_module.ModelConfig, "build", with_dropout)
    study = mm_study(encoder_run)
    study["modes"]["fp16-dynamic"]["scaler"]["init_scale"] = 2.0 ** 40  # far above FP16's range: they overflow
    plain = train(resolve_run(study, "vlm", "fp16-dynamic", 0), tmp_path / "a", progress=open("/dev/null", "w"))
    study["train"]["settle_steps"] = 4
    settled = train(resolve_run(study, "vlm", "fp16-dynamic", 0), tmp_path / "b", progress=open("/dev/null", "w"))
    assert settled["settle_steps"] == 4 and settled["settle_overflows"] == 4  # 2^40 -> 2^36 in four halvings
    steps_a = [json.loads(json.dumps(r)) for r in _rows(tmp_path / "a")]
    steps_b = _rows(tmp_path / "b")
    assert steps_b[0]["scale"] == 2.0 ** 36 and steps_a[0]["scale"] == 2.0 ** 40
    # the weights, the data order and the dropout draws are the same at training's first step: the same loss
    assert steps_b[0]["loss"] == steps_a[0]["loss"]
    assert settled["first_batch_sha"] == plain["first_batch_sha"]
    # training's own counters start at its step 0
    assert settled["overflow_steps"] == sum(int(r["found_inf"]) for r in steps_b)
    assert 0 < settled["settle_time_s"] <= settled["train_time_s"]


def _rows(run_dir):
    import csv
    with open(run_dir / "steps.csv") as f:
        return [{k: float(v) if k in ("scale", "loss", "found_inf") else v for k, v in r.items()}
                for r in csv.DictReader(f)]


def test_first_steps_are_the_runs_own_or_refused(encoder_run, tmp_path):
    from lab.report.first_steps import FirstStepsError, measure
    study = mm_study(encoder_run)
    run = resolve_run(study, "vlm", "fp16-dynamic", 0)
    out = tmp_path / "run"
    train(run, out, progress=open("/dev/null", "w"))
    table = measure(run, 2, out)  # checked against the run's steps.csv: the same losses
    assert list(table["step"]) == [0, 1] and (table["feature_std"] > 0).all()
    assert (table["scale"] == 2.0 ** 16).all() and (table["encoder_grad_amax"] > 0).all()
    steps = (out / "steps.csv").read_text().splitlines()
    head, first = steps[0].split(","), steps[1].split(",")
    first[head.index("loss")] = "9.0"  # another trajectory
    (out / "steps.csv").write_text("\n".join([steps[0], ",".join(first), *steps[2:]]) + "\n")
    with pytest.raises(FirstStepsError, match="not the run's own.*first differing step 0"):
        measure(run, 2, out)
    with pytest.raises(FirstStepsError, match="not a vision-language model"):
        measure(resolve_run(study, "vit_encoder", "fp32", 0), 1)

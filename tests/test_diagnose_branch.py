"""`lab diagnose` on a multimodal FP16 run that goes NaN names the branch and the forward or backward origin
(lab/diagnose/branch.py).

configs/multimodal.yaml's vision-language model, shrunk to 30 steps, on its encoder's run (5 steps of FP32
pre-training, for weights.pt), with a fault planted at one step: a NaN added to an encoder module's forward output
(the forward pass leaves FP16's range in the vision branch: the loss is NaN), or a NaN gradient at a decoder
module's output (the backward pass, in the language branch). The initial scale is low enough that the model never
overflows on its own: the planted step is the only overflow. The diagnosis must name that branch and that pass;
other families' reports name no branch.
"""
import copy
import io
import json

import pytest
import yaml

from conftest import REPO
from lab.core.config import resolve_run, validate_study
from lab.diagnose import diagnose, format_text
from lab.run.train import train

STEP = 12
FORWARD = {"step": STEP, "into": "activation", "module": "encoder.blocks.1.mlp.fc2", "value": "nan"}
BACKWARD = {"step": STEP, "into": "activation_grad", "module": "decoder.blocks.1.attn.proj", "value": "nan"}


def study(results_dir, faults=()) -> dict:
    """configs/multimodal.yaml's data, training and two families (the encoder and the VLM), small."""
    s = yaml.safe_load((REPO / "configs" / "multimodal.yaml").read_text())
    s.pop("claims_file", None)
    s.update(results_dir=str(results_dir), seeds=[0], device="cpu", compare=[])
    s["train"].update(epochs=1, max_steps=30, log_every=10, census_every=10, attribution_replays=4)
    enc, vlm = (copy.deepcopy(s["models"][k]) for k in ("vit_encoder", "vlm"))
    enc.update(modes=["fp32"], train={**(enc.get("train") or {}), "epochs": 1, "max_steps": 5})
    vlm.pop("modes", None)
    vlm["train"] = {"faults": [dict(f) for f in faults]}
    s["models"] = {"vit_encoder": enc, "vlm": vlm}
    s["modes"] = {"fp32": {"precision": "fp32"},
                  "fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 1024}}}
    return validate_study(s)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The encoder's run, where the VLM family loads it from (train.save_weights is set by resolve_run)."""
    root = tmp_path_factory.mktemp("multimodal")
    cfg = resolve_run(study(root), "vit_encoder", "fp32", 0)
    assert cfg.train.save_weights
    train(cfg, root / "runs" / "vit_encoder" / "fp32" / "seed0", progress=io.StringIO())
    return root


def vlm_run(root, name, fault):
    out = root / "runs" / "vlm" / "fp16-dynamic" / name
    train(resolve_run(study(root, [fault]), "vlm", "fp16-dynamic", 0), out, progress=io.StringIO())
    return diagnose(out)


def finding(d, code):
    return next(f for f in d.findings if f.code == code)


def test_a_forward_overflow_in_the_encoder_is_the_vision_branch_forward(results):
    d = vlm_run(results, "forward", FORWARD)
    assert d.nonfinite_loss_steps == 1 and d.first_nonfinite_loss_step == STEP  # the run went NaN there
    assert d.unplanted_overflow_steps == []
    assert {k: (e["steps"], e["forward"], e["backward"]) for k, e in d.overflow_branches.items()} == {
        "encoder": (1, 1, 0)}
    assert d.forward_overflow["module"] == FORWARD["module"] and d.forward_overflow["branch"] == "encoder"
    text = format_text(d)
    assert "overflow branch   vision branch (encoder) x1 (forward x1)" in text
    # the headline (the model's problem) and the findings name the branch and the pass
    assert "forward pass left FP16's range first at encoder.blocks.1.mlp.fc2 (Linear) in the vision branch " \
           "(encoder)" in d.headline
    msg = finding(d, "overflow_branch").message
    assert "the vision branch (encoder) on 1 of 1 overflow steps (first at step 12), from the forward pass" in msg
    assert "language branch" not in msg and "backward pass" not in msg
    assert json.loads(json.dumps(d.to_dict()))["overflow_branches"]["encoder"]["forward_modules"] == {
        "encoder.blocks.1.mlp.fc2 (Linear)": 1}


def test_a_nan_gradient_in_the_decoder_is_the_language_branch_backward(results):
    d = vlm_run(results, "backward", BACKWARD)
    assert d.nonfinite_loss_steps == 0 and d.unplanted_overflow_steps == [] and d.forward_overflow is None
    assert {k: (e["steps"], e["forward"], e["backward"]) for k, e in d.overflow_branches.items()} == {
        "decoder": (1, 0, 1)}
    text = format_text(d)
    assert "overflow branch   language branch (decoder) x1 (backward x1)" in text
    msg = finding(d, "overflow_branch").message
    assert ("the language branch (decoder) on 1 of 1 overflow steps (first at step 12), from the backward pass on 1 "
            "(the first non-finite gradient: decoder.blocks.1.attn.proj (activation_grad) x1)") in msg
    assert "vision branch" not in msg and "forward pass" not in msg
    assert "decoder.blocks.1.attn.proj (activation_grad) in the language branch (decoder) on 1 of 1" in \
        finding(d, "overflow_layers").message


# --- without training: recorded files ------------------------------------------------------------------------
HEADER = ("step,epoch,loss,scale,found_inf,skipped,precision,first_nonfinite_layer,first_nonfinite_source,"
          "forward_overflow_module,forward_overflow_type,forward_amax\n")


def write_run(path, preset, rows):
    path.mkdir()
    (path / "metrics.json").write_text(json.dumps({"model": "m", "mode": "fp16", "seed": 0, "precision": "fp16",
                                                   "scaler": "dynamic", "status": "ok"}))
    (path / "config.yaml").write_text(yaml.safe_dump({"model": {"family": "m", "preset": preset}}))
    clean = [f"{i},0,1.0,1024,0,0,fp16,,,,," for i in range(20)]
    (path / "steps.csv").write_text(HEADER + "\n".join(clean + rows) + "\n")
    return path


def test_projector_and_an_unlocated_nan_loss(tmp_path):
    """A projector's gradient (backward); a NaN loss no replay located: the forward pass, branch not located (the
    gradient column names where the NaN showed, which is not its origin)."""
    d = diagnose(write_run(tmp_path / "vlm", "vlm-digits", [
        "20,0,1.0,1024,1,1,fp16,projector,param_grad,,,",
        "21,0,nan,512,1,1,fp16,decoder.head,activation_grad,,,",
        "22,0,1.0,256,1,1,fp16,,,,,"]))
    assert {k: (e["steps"], e["forward"], e["backward"], e["unknown"]) for k, e in d.overflow_branches.items()} == {
        "projector": (1, 0, 1, 0), "unlocated": (2, 1, 0, 1)}
    assert "overflow branch   projector x1 (backward x1), not located x2 (forward x1, unknown x1)" in format_text(d)


def test_other_families_name_no_branch(tmp_path):
    """A family that is not a vision-language model, even with modules named encoder.*: no branch anywhere."""
    d = diagnose(write_run(tmp_path / "t5", "t5-small", [
        "20,0,1.0,1024,1,1,fp16,encoder.block.0,activation_grad,,,",
        "21,0,nan,512,1,1,fp16,,,decoder.block.1,Linear,inf"]))
    assert d.overflow_branches is None
    text = format_text(d)
    assert "branch" not in text and "overflow layers   encoder.block.0 (activation_grad) x1" in text

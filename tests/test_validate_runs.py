"""`lab validate` refuses what `lab train` would refuse in a run, in the same words (lab/core/run_checks.py, one check
that both ask), and `lab train` refuses it before its run directory is touched: no folder, no .lock, no config.yaml,
no failed metrics.json."""
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tiny_study
from lab.cli import main

LM = {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 32, "vocab_size": 1024, "val_fraction": 0.3}}

# (the study, its run, words the one line must hold: the key, the value, what is allowed)
CASES = {
    "position-probe-on-a-vit": (
        {"models": {"vit": {"preset": "vit-tiny-digits", "train": {"position_probe": True}}},
         "modes": {"fp32": {"precision": "fp32"}}},
        ("vit", "fp32"),
        ["models.vit, mode fp32: train.position_probe: true", "'vit-tiny-digits'", "expected false",
         "pydoc, text, tokens"]),
    "checkpointing-a-resnet": (
        {"models": {"resnet50": {"preset": "resnet50-digits"}},
         "modes": {"fp32": {"precision": "fp32", "train": {"gradient_checkpointing": True}}}},
        ("resnet50", "fp32"),
        ["models.resnet50, mode fp32: train.gradient_checkpointing: true", "'resnet50-digits' has none",
         "expected false"]),
    "a-clip-group-naming-no-parameter": (
        {"models": {"lm": {**LM, "train": {"clip_groups": {"vision": 0.5}}}},
         "modes": {"fp32": {"precision": "fp32"}}},
        ("lm", "fp32"),
        ["models.lm, mode fp32: train.clip_groups: 'vision' names no trainable parameter", "start with"]),
    "a-qat-group-that-divides-no-linear": (
        {"models": {"lm": LM}, "modes": {"q": {"precision": "fp16", "scaler": {"policy": "dynamic"},
                                               "qat": {"group_size": 48}}}},
        ("lm", "q"),
        # gpt-tiny's linears: width 64 in, the MLP's projection 256 in: a group must divide 64
        ["models.lm, mode q: qat.group_size: 48 does not divide", "blocks.0.attn.qkv (64)",
         "blocks.0.mlp.proj (256)", "expected a divisor of every converted linear's in_features "
         "(1, 2, 4, 8, 16, 32, 64)", "qat.keep_high"]),
}


def config_file(tmp_path, study_part: dict):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(**study_part)))
    return path


def refusal(capsys, argv) -> str:
    """The one line a refused command prints (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("case", CASES)
def test_validate_refuses_what_train_refuses_in_the_same_words_and_train_writes_nothing(case, tmp_path, capsys):
    study_part, (model, mode), words = CASES[case]
    config = config_file(tmp_path, study_part)
    said = refusal(capsys, ["validate", "--config", str(config)])
    assert all(w in said for w in words), said
    out = tmp_path / "results" / "runs" / model / mode / "seed0"
    trained = refusal(capsys, ["train", "--config", str(config), "--model", model, "--mode", mode, "--out", str(out)])
    assert trained == said
    assert not (tmp_path / "results").exists()  # not the run folder, nor any folder above it


def test_a_set_override_is_checked_as_the_config_would_be(tmp_path):
    """`lab train --set` makes a run the config did not hold: refused by the same check, in the same words, with
    several seeds too (each trains in a child process: its refusal is one line as well), writing nothing."""
    study_part, (model, mode), words = CASES["a-qat-group-that-divides-no-linear"]
    good = {"models": study_part["models"], "modes": {"q": {**study_part["modes"]["q"], "qat": {"group_size": 32}}}}
    config = config_file(tmp_path, good)
    out = tmp_path / "runs" / "seed{seed}"
    res = subprocess.run([sys.executable, "-m", "lab", "train", "--config", str(config), "--model", model, "--mode",
                          mode, "--seed", "0", "--seed", "1", "--out", str(out), "--set", "mode.qat.group_size=48"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    said = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and all(w in said[0] for w in words), res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_fine_tune_whose_base_has_not_trained_is_checked_without_its_weights(tmp_path, capsys):
    """A study's validation comes before any run: a LoRA family's model is built on the meta device without its
    base run's weights, and its checkpointing accepted (the GPT inside the LoRA wrapper is what checkpoints)."""
    modes = {"fp32": {"precision": "fp32"}, "ckpt": {"precision": "fp32", "train": {"gradient_checkpointing": True}}}
    study = {"models": {"base": {**LM, "modes": ["fp32"]},
                        "ft": {**LM, "modes": ["ckpt"], "finetune": {"base": {"family": "base"}}}},
             "modes": modes}
    config = config_file(tmp_path, study)
    assert main(["validate", "--config", str(config)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("config OK")


def test_the_workflow_refuses_it_before_any_job_in_the_same_words(repo_copy, tmp_path, capsys):
    """`snakemake --configfile` (the README's command, without make study's `lab validate` first) asks the same
    check when it reads the config: the one line `lab validate` prints, and no results folder."""
    from test_workflow import snakemake
    study_part, _, _ = CASES["checkpointing-a-resnet"]
    config = config_file(tmp_path, study_part)
    said = refusal(capsys, ["validate", "--config", str(config)])
    res = snakemake(repo_copy, "--cores", "1", "--configfile", str(config))
    assert res.returncode != 0
    assert said.removeprefix("error: ") in res.stderr, res.stderr[-2000:]
    assert not (repo_copy / "results").exists()

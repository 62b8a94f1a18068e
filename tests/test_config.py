
import dataclasses
import re

import pytest
import yaml

from lab.core.config import ConfigError, apply_overrides, load_study, resolve_run, save_study, validate_study
from lab.core.study import study_runs

from conftest import REPO, tiny_study


def test_shipped_configs_validate(tmp_path):
    default = load_study([REPO / "configs" / "default.yaml"])
    per_family = {m: len(e.get("seeds", default["seeds"])) for m, e in default["models"].items()}
    modes = {m: [x for x in default["modes"] if x in e.get("modes", default["modes"])]
             for m, e in default["models"].items()}
    assert len(study_runs(default)) == sum(per_family[m] * len(modes[m]) for m in per_family)
    assert per_family["lm"] == 6 and per_family["vit"] == len(default["seeds"])
    # every mode a claim of configs/claims.yaml names is trained on the family it names
    claims = yaml.safe_load((REPO / "configs" / "claims.yaml").read_text())["claims"]
    named = set(re.findall(r"'model': '(\w+)', 'mode': '([\w.+-]+)'", repr(claims)))
    assert named and all(mode in modes[model] for model, mode in named), named
    assert {"fp32", "fp16-noscale", "fp16-static128", "fp16-static1024", "fp16-dynamic",
            "bf16"} <= set(default["modes"])
    assert set(default["models"]) == {"resnet50", "mobilenetv2", "vit", "lm"}
    lm = resolve_run(default, "lm", "fp32", 0)
    # the LM trains long enough for every policy to act, at the backward magnitudes of a 32768-token step
    assert lm.data.name == "pydoc" and lm.data.context == 32 and lm.train.max_steps >= 300
    assert lm.train.batch_size * lm.data.context * lm.train.accum_steps * lm.train.emulated_accum == 32768
    assert resolve_run(default, "vit", "fp32", 0).data.name == "digits"  # a family's data does not leak
    with pytest.raises(ConfigError, match="data.path"):  # ships pointing at /data/imagenet, absent here
        load_study([REPO / "configs" / "imagenet.yaml"])
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({"data": {"path": str(tmp_path)}}))
    with pytest.raises(ConfigError, match="models.lm.data.path"):  # and the text corpus at /data/text
        load_study([REPO / "configs" / "imagenet.yaml", local])
    local.write_text(yaml.safe_dump({"data": {"path": str(tmp_path)},
                                     "models": {"lm": {"data": {"path": str(tmp_path)}}}}))
    imagenet = load_study([REPO / "configs" / "imagenet.yaml", local])
    assert imagenet["data"]["image_size"] == 224 and imagenet["train"]["lr"] == 1e-4
    assert resolve_run(imagenet, "lm", "fp16-dynamic", 0).data.context == 1024
    sweep = load_study([REPO / "configs" / "lm_tokens.yaml"])
    tokens = [resolve_run(sweep, m, "fp32", 0) for m in sweep["models"]]
    assert [c.train.batch_size * c.data.context * c.train.accum_steps for c in tokens] == [2048, 8192, 32768, 65536]


def check_error(study, *fragments):
    with pytest.raises(ConfigError) as err:
        validate_study(study)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_unknown_key_names_key_and_allowed_keys():
    study = tiny_study()
    study["train"]["epochz"] = 3
    check_error(study, "train", "'epochz'", "allowed keys", "epochs", "batch_size")


def test_bad_enum_value_lists_allowed_values():
    study = tiny_study()
    study["modes"]["fp32"]["precision"] = "fp8"
    check_error(study, "modes.fp32.precision", "'fp8'", "fp32, fp16, bf16")


def test_unknown_policy_lists_registered_policies():
    study = tiny_study()
    study["modes"]["fp16-static128"]["scaler"]["policy"] = "magic"
    check_error(study, "modes.fp16-static128.scaler", "magic", "dynamic", "hysteresis", "static")


def test_bad_policy_parameter_is_named():
    study = tiny_study()
    study["modes"]["fp16-static128"]["scaler"]["growth_intervall"] = 5
    check_error(study, "modes.fp16-static128.scaler", "growth_intervall")


def test_unknown_preset_and_scaler_on_bf16():
    study = tiny_study()
    study["models"]["vit"]["preset"] = "vit-huge"
    study["modes"]["bf16"] = {"precision": "bf16", "scaler": {"policy": "dynamic"}}
    check_error(study, "models.vit.preset", "vit-tiny-digits", "modes.bf16.scaler", "fp16 only")


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_study([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_study([bad])


def test_later_files_merge_over_earlier(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"seeds": [3], "modes": {"fp16-x": {"precision": "fp16",
                                                                         "scaler": {"policy": "static", "scale": 8}}}}))
    study = load_study([REPO / "configs" / "default.yaml", extra])
    assert study["seeds"] == [3] and "fp16-x" in study["modes"] and "fp32" in study["modes"]


def test_resolve_and_override():
    study = validate_study(tiny_study())
    run = resolve_run(study, "vit", "fp16-static128", 1)
    assert run.mode.scaler == {"policy": "static", "scale": 128} and run.seed == 1
    run2 = apply_overrides(run, ["train.epochs=5", "mode.scaler.scale=1024"])
    assert run2.train.epochs == 5 and run2.mode.scaler["scale"] == 1024 and run2.hash() != run.hash()
    with pytest.raises(ConfigError, match="unknown key 'epochz'"):
        apply_overrides(run, ["train.epochz=5"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(run, ["train.epochs"])
    with pytest.raises(ConfigError, match="unknown mode"):
        resolve_run(study, "vit", "fp16-nope", 0)


def test_changing_a_mode_changes_only_its_runs_hashes():
    a = validate_study(tiny_study())
    b_raw = tiny_study()
    b_raw["modes"]["fp16-static128"]["scaler"]["scale"] = 256
    b = validate_study(b_raw)
    for model, mode, seed in study_runs(a):
        same = resolve_run(a, model, mode, seed).hash() == resolve_run(b, model, mode, seed).hash()
        assert same == (mode != "fp16-static128")


def test_a_run_config_is_frozen_and_a_changed_one_is_new():
    """Its hash is computed once (RunConfig.hash): what it fingerprints cannot change under it."""
    run = resolve_run(validate_study(tiny_study()), "vit", "fp32", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.epochs = 9
    assert dataclasses.replace(run, seed=1).hash() != run.hash() == dataclasses.replace(run, threads=4).hash()


def test_a_saved_study_reads_back_the_same_and_is_rewritten_only_when_it_changes(tmp_path):
    """save_study: the file every workflow job reads (workflow/rules/common.smk), overrides included."""
    study = load_study()
    study["results_dir"] = str(tmp_path / "moved")  # what `snakemake --config results_dir=...` changes
    path = tmp_path / "moved" / "study.yaml"
    assert save_study(study, path) and load_study([path]) == study
    written = path.stat().st_mtime_ns
    assert not save_study(load_study([path]), path) and path.stat().st_mtime_ns == written
    study["seeds"] = [7]
    assert save_study(study, path) and load_study([path])["seeds"] == [7]


def test_missing_data_path_fails_at_validation(tmp_path):
    study = tiny_study()
    study["data"].update(name="cifar10", path=str(tmp_path / "no-cifar"))
    check_error(study, "data.path", "cifar10", str(tmp_path / "no-cifar"))


def test_validating_a_study_imports_no_torch():
    """Snakemake validates the study each time it reads the Snakefile (`snakemake -n` included): the policy
    registry, each policy's and the engine's checks and the preset names need no torch (~4 s to import here, half
    of a dry run's time); the engine, the models and the adapter check load it when a run needs them."""
    import subprocess
    import sys
    code = ("import sys, yaml; from lab.core.config import validate_study; "
            "validate_study(yaml.safe_load(open('configs/default.yaml'))); "
            "from lab import scaling; scaling.check('dynamic', init_scale=8.0, alert_after=2); "
            "print(sorted(m for m in ('torch', 'timm') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]


def test_check_refuses_what_create_refuses():
    """scaling.check (the validation's) and scaling.create (a run's) refuse the same parameters, with the same
    words; check returns the policy create would run."""
    from lab import scaling
    for params in ({"growth_factor": 1.0}, {"alert_after": 0}, {"enabled": "yes"}, {"nonsense": 1}):
        with pytest.raises(scaling.ScalingConfigError) as by_check:
            scaling.check("dynamic", **params)
        with pytest.raises(scaling.ScalingConfigError) as by_create:
            scaling.create("dynamic", device="cpu", **params)
        assert str(by_check.value) == str(by_create.value)
    policy = scaling.check("dynamic", init_scale=8.0, fp32_fallback_after=3)
    assert type(policy) is type(scaling.create("dynamic", init_scale=8.0, device="cpu").policy)
    assert policy.init_scale == 8.0


def test_the_cpu_studies_stay_on_the_cpu_and_say_what_they_run(monkeypatch, capsys):
    """On a machine with a GPU, `make study` must not regenerate the committed CPU tables from CUDA's
    numerics: every config that names no GPU pins device: cpu, and `lab validate` (make study's first line) says
    where the runs train and whose numerics they hold."""
    import torch
    from conftest import REPO
    from lab.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    for path in sorted((REPO / "configs").glob("*.yaml")):
        study = yaml.safe_load(path.read_text())
        if path.name.startswith("claims"):
            continue
        assert study["device"] == ("cuda" if "gpu" in study else "cpu"), path.name
    assert main(["validate"]) == 0
    assert "runs on: cpu: the CPU's FP32 kernels, FP16/BF16 under the tensor-core contract" in capsys.readouterr().out
    from lab.commands.validate import _runs_on
    assert _runs_on({"device": "auto", "results_dir": "r"}).startswith("runs on: cuda (device: auto")

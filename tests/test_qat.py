"""Quantization-aware training (lab/models/qat.py, configs/qat.yaml): a mode's `qat:` puts torchao's fake quantizers on
the model's linears; the lab's recorder leaves such a loop's arithmetic alone (bit for bit), the lab's own training
loop runs it, and `lab diagnose` reads its runs."""
import copy

import pytest
import torch
import torch.nn as nn

import lab
import lab.scaling
from conftest import assert_valid_diagnosis, tiny_study
from lab.core.config import resolve_run, validate_study
from lab.core.errors import ConfigError
from lab.models import qat

pytest.importorskip("torchao")
V, T = 64, 16


def gpt():
    from lab.models.presets import create_model
    torch.manual_seed(0)
    return create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (8, T), generator=g) for _ in range(n)]


def test_prepare_is_torchaos_qat_with_the_documented_defaults():
    """prepare() with no settings: torchao's quantize_ with int8 per-token asymmetric inputs and int4 weights in
    groups of 32 on every nn.Linear: the same forward, bit for bit, as that call made directly."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    ours = qat.prepare(gpt())
    theirs = gpt()
    quantize_(theirs, QATConfig(activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
                                weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32), step="prepare"))
    assert qat.fake_quantized(ours) == [n for n, m in gpt().named_modules() if type(m) is nn.Linear]
    x = batches(1)[0]
    with lab.autocast("cpu", torch.float16):
        a, b = ours(x), theirs(x)
    assert torch.equal(a, b)
    # and the fake quantizer does change the forward: not the plain model's
    with lab.autocast("cpu", torch.float16):
        assert not torch.equal(a, gpt()(x))


def test_keep_high_and_weight_only():
    model = qat.prepare(gpt(), keep_high=["head", "*.mlp.*"], activation_bits=None)
    names = qat.fake_quantized(model)
    assert names == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.attn.qkv", "blocks.1.attn.proj"]
    assert all(model.get_submodule(n).activation_fake_quantizer is None for n in names)


@pytest.mark.parametrize("settings,words", [
    ({"weight_bit": 4}, "unknown setting 'weight_bit' (did you mean 'weight_bits'?)"),
    ({"weight_bits": 16}, "weight_bits must be one of 2, 3, 4, 5, 6, 7, 8, got 16"),
    ({"group_size": 0}, "group_size must be >= 1, got 0"),
    ({"activation_granularity": "per_tok"}, "did you mean 'per_token'?"),
    # torchao's fake quantizer has no per-tensor activation scale: refused here, not at the run's first forward
    ({"activation_granularity": "per_tensor"}, "activation_granularity must be one of per_token, got 'per_tensor'"),
    ({"keep_high": "head"}, "keep_high must be a list of strings"),
])
def test_bad_qat_settings_are_refused_in_one_line_before_any_run(settings, words):
    study = tiny_study(modes={"q": {"precision": "fp16", "scaler": {"policy": "dynamic"}, "qat": settings}})
    with pytest.raises(ConfigError) as e:
        validate_study(study)
    assert words in str(e.value) and "modes.q.qat" in str(e.value)


def test_qat_beside_a_recipe_or_with_a_ragged_group_is_refused():
    study = tiny_study(modes={"q": {"precision": "bf16", "recipe": "fp8-current", "qat": {}}})
    with pytest.raises(ConfigError, match="a recipe or qat, not both"):
        validate_study(study)
    with pytest.raises(ConfigError, match=r"group_size: 48 does not divide the in_features of blocks.0.attn.qkv "):
        qat.prepare(gpt(), group_size=48)


def loop(model, opt, scaler, rec, data):
    """A user's FP16 loop over the QAT model; returns its losses (rec None: the same loop unrecorded)."""
    losses = []
    for x in data:
        with lab.autocast("cpu", torch.float16):
            loss = nn.functional.cross_entropy(model(x).float().reshape(-1, V), x.reshape(-1))
        scaler.scale(loss * 2.0 ** -12).backward()  # small gradients: the scale matters
        scaler.step(opt)
        scaler.update()
        if rec is not None:
            rec.step(loss)
        losses.append(loss.detach())
        opt.zero_grad(set_to_none=True)
    return losses


def test_a_recorded_qat_loop_equals_the_same_loop_unrecorded_bit_for_bit(tmp_path):
    """lab.record over torchao's fake-quantized GPT, with a census every 2 steps (each replayed in FP32: the fake
    quantizers run again) and a replay of every overflow step, changes nothing the loop computes: its losses, scales
    and weights equal the unrecorded loop's bit for bit; lab diagnose reads the run."""
    runs = []
    for recorded in (False, True):
        model = qat.prepare(gpt())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = lab.scaling.create("dynamic", device="cpu", init_scale=2.0 ** 40, growth_interval=3)
        data = batches(8)
        if recorded:
            step = {"i": 0}

            def replay():  # the step again on its batch: the recorder names where the overflow began
                x = data[step["i"]]
                with lab.autocast("cpu", torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float().reshape(-1, V), x.reshape(-1))
                scaler.scale(loss * 2.0 ** -12).backward()

            class Counted(list):
                def __iter__(self):
                    for i, x in enumerate(list.__iter__(self)):
                        step["i"] = i
                        yield x
            with lab.record(model, scaler, out=tmp_path / "run", optimizer=opt, census_every=2,
                            replay=replay) as rec:
                losses = loop(model, opt, scaler, rec, Counted(data))
        else:
            losses = loop(model, opt, scaler, None, data)
        runs.append((losses, scaler.get_scale(), copy.deepcopy(model.state_dict())))
    (plain_losses, plain_scale, plain_state), (rec_losses, rec_scale, rec_state) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, rec_losses)) and plain_scale == rec_scale
    assert plain_state.keys() == rec_state.keys()
    assert all(torch.equal(plain_state[k], rec_state[k]) for k in plain_state)
    import json
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["census_steps"] == 4 and m["attribution_replays"] >= 1  # the recorder's FP32 and overflow replays ran
    d = lab.diagnose.diagnose(tmp_path / "run")
    assert_valid_diagnosis(d)
    assert d.skipped_steps >= 1
    # the recorder read the fake quantizers back as the mode's settings: diagnose names them
    assert d.qat == {"activation_bits": 8, "activation_granularity": "per_token", "activation_symmetric": False,
                     "weight_bits": 4, "group_size": 32}
    assert "torchao's fake quantizers, int4 weights in groups of 32, int8 per_token inputs (asymmetric)" in \
        lab.diagnose.format_text(d)  # from 2^40 the first steps overflow: the replay and the census both ran


def test_the_labs_loop_trains_a_qat_mode_and_diagnose_reads_it(tmp_path):
    """A study's qat mode: the lab's own training loop fake-quantizes every linear (the run's config records the
    settings), trains, and lab diagnose reads the run."""
    import yaml
    from lab.run.train import train
    study = tiny_study(models={"lm": {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 32,
                                                                     "vocab_size": 1024, "val_fraction": 0.3}}},
                       modes={"q": {"precision": "fp16", "scaler": {"policy": "dynamic"}, "qat": {"group_size": 16}}})
    study["train"].update(max_steps=4, census_every=2)
    cfg = resolve_run(validate_study(study), "lm", "q", 0)
    out = tmp_path / "run"
    seen = {}
    build = qat.prepare

    def spy(model, **settings):
        seen.update(settings)
        return build(model, **settings)
    import lab.models.qat as module
    module.prepare, saved = spy, module.prepare
    try:
        train(cfg, out)
    finally:
        module.prepare = saved
    assert seen == {"group_size": 16}
    assert yaml.safe_load((out / "config.yaml").read_text())["mode"]["qat"] == {"group_size": 16}
    d = lab.diagnose.diagnose(out)
    assert_valid_diagnosis(d)
    assert d.steps == 4 and d.qat == {"group_size": 16}
    assert "int4 weights in groups of 16" in lab.diagnose.format_text(d)


def test_a_model_without_fake_quantizers_records_no_qat():
    assert qat.settings_of(gpt()) is None
    weight_only = qat.prepare(gpt(), activation_bits=None, weight_bits=8, group_size=16)
    assert qat.settings_of(weight_only) == {"activation_bits": None, "weight_bits": 8, "group_size": 16}


def test_a_users_activation_granularity_is_read_back_by_torchaos_name():
    """settings_of names the granularity a user's own torchao call chose (per_channel here), not one it lacks."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    model = gpt()
    quantize_(model, QATConfig(activation_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"),
                               weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32), step="prepare"))
    assert qat.settings_of(model)["activation_granularity"] == "per_channel"

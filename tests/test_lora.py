"""LoRA fine-tuning over an FP16 base (lab/models/lora.py, configs/finetune.yaml): the corpus halves, the base run's
weights and their hash, FP16 base and FP32 adapters, the adapters' census and log (lab/numerics/adapters.py), and
`lab diagnose` on real runs made to have each adapter failure (lab/diagnose/adapters.py)."""
import copy
import io
import json

import pandas as pd
import pytest
import torch
import yaml

from conftest import REPO
from lab.core.config import ConfigError, resolve_run, validate_study
from lab.data.text import load_corpus
from lab.diagnose import diagnose
from lab.models.lora import widened_to_fp32
from lab.run.train import train

FINETUNE = yaml.safe_load((REPO / "configs" / "finetune.yaml").read_text())


def study(results, **modes):
    s = copy.deepcopy(FINETUNE)
    s.update(results_dir=str(results), device="cpu", seeds=[0])
    s["train"].update(batch_size=8, max_steps=25, log_every=5, census_every=10)
    s["models"]["lm_base"]["train"] = {"max_steps": 10}  # a base to load, not a good one
    s["models"]["lm_lora"]["modes"] = ["fp32", *modes]
    s["modes"].update(modes)
    return validate_study(s)


def run(s, family, mode, results, out_root=None):
    """Train one run; its folder under out_root (a test's own tmp_path), else where the study puts it."""
    out = (out_root or results / "runs") / family / mode / "seed0"
    metrics = train(resolve_run(s, family, mode, 0), out, progress=io.StringIO())
    return metrics, out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    results = tmp_path_factory.mktemp("finetune")
    metrics, out = run(study(results), "lm_base", "fp32", results)
    return results, metrics, out


def test_the_halves_share_the_base_vocabulary_and_no_document():
    pre = load_corpus("pydoc", None, 1024, 0.1, 0, "pretrain")
    fine = load_corpus("pydoc", None, 1024, 0.1, 0, "finetune")
    assert pre[2] == fine[2]  # the same vocabulary: the base's token ids mean the same words
    assert not {n for n, _ in pre[3]} & {n for n, _ in fine[3]}
    whole = load_corpus("pydoc", None, 1024, 0.1, 0)
    assert len(pre[0]) + len(pre[1]) + len(fine[0]) + len(fine[1]) == len(whole[0]) + len(whole[1])


def test_a_finetune_must_name_a_base_the_study_trains(tmp_path):
    s = copy.deepcopy(FINETUNE)
    s["models"]["lm_lora"]["finetune"]["base"]["family"] = "lm_bse"
    with pytest.raises(ConfigError, match="finetune.base.family.*'lm_bse'.*did you mean 'lm_base'"):
        validate_study(s)
    s["models"]["lm_lora"]["finetune"]["base"] = {"family": "lm_base", "seed": 3}
    with pytest.raises(ConfigError, match=r"finetune.base.seed: expected one of 'lm_base'"):
        validate_study(s)
    s["models"]["lm_lora"]["finetune"]["base"] = {"family": "lm_base"}
    s["models"]["lm_lora"]["data"]["vocab_size"] = 512
    with pytest.raises(ConfigError, match="expected the base's corpus"):
        validate_study(s)


def test_base_weights_their_hash_and_the_finetune_dtypes(base, tmp_path):
    results, metrics, out = base
    assert (out / "weights.pt").is_file() and len(metrics["weights_sha256"]) == 64
    s = study(results, **{"fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}})
    for mode, base_dtype in (("fp32", torch.float32), ("fp16-dynamic", torch.float16)):
        cfg = resolve_run(s, "lm_lora", mode, 0)
        model = cfg.model.build(1024, 0, 32, cfg.mode.precision)
        frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
        adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert {p.dtype for p in frozen} == {base_dtype} and {p.dtype for _, p in adapters} == {torch.float32}
        assert adapters and all("lora_" in n for n, _ in adapters)
        assert model.lab_base["weights_sha256"] == metrics["weights_sha256"]
    # the base's own weights, as saved (an FP16 mode's base is their FP16 rounding)
    saved = torch.load(out / "weights.pt", weights_only=True)
    assert torch.equal(model.base_model.model.tok.weight, saved["tok.weight"].half())


def test_widened_to_fp32_is_exact_and_restores_the_dtypes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].half()
    before = [p.detach().clone() for p in model.parameters()]
    with widened_to_fp32(model):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert all(torch.equal(p.double(), b.double()) for p, b in zip(model.parameters(), before))
    assert [p.dtype for p in model.parameters()] == [b.dtype for b in before]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_healthy_fp16_finetune_records_its_adapters(base):
    results, base_metrics, _ = base
    s = study(results, **{"fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}})
    metrics, out = run(s, "lm_lora", "fp16-dynamic", results)
    assert metrics["status"] == "ok" and metrics["base_model"]["base_dtype"] == "float16"
    assert metrics["base_model"]["weights_sha256"] == base_metrics["weights_sha256"]
    adapters = pd.read_csv(out / "adapters.csv")
    assert sorted(adapters["step"].unique()) == [0, 5, 10, 15, 20]
    assert adapters["adapter"].nunique() == 8 and (adapters["b_norm"] > 0).all()  # 2 blocks x qkv, proj, fc, proj
    census = pd.read_csv(out / "census.csv")
    ada = census[census["source"] == "adapter_grad"]
    assert set(ada["layer"]) - {"__total__"} and all(".lora_" in n for n in set(ada["layer"]) - {"__total__"})
    assert metrics["flushed_adapter"] is not None
    d = diagnose(out)
    assert not {"adapters_not_training", "adapters_nonfinite", "adapter_grads_flushed"} & {f.code for f in d.findings}
    assert set(d.adapters) == set(adapters["adapter"])


@pytest.mark.parametrize("case", ["every_step_skipped", "flushed", "nonfinite"])
def test_each_planted_adapter_failure_is_diagnosed_with_its_cause(base, case):
    results = base[0]
    modes = {"every_step_skipped": {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}},
             "flushed": {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** -30}},
             "nonfinite": {"precision": "fp16", "scaler": {"policy": "none"}}}
    s = study(results, **{f"fp16-{case}": modes[case]})
    if case == "nonfinite":  # a NaN into the frozen base's activation gradient, applied by a policy that never skips
        s["models"]["lm_lora"].setdefault("train", {})["faults"] = [
            {"step": 7, "into": "activation_grad", "module": "base_model.model.blocks.1.mlp.fc.base_layer",
             "value": "nan"}]
    _, out = run(s, "lm_lora", f"fp16-{case}", results)
    found = {f.code: f for f in diagnose(out).findings}
    if case == "nonfinite":
        assert "adapters_nonfinite" in found and found["adapters_nonfinite"].severity == "problem"
        assert "adapters_not_training" not in found
        return
    f = found["adapters_not_training"]
    assert f.severity == "problem" and f.evidence["cause"] == case and len(f.evidence["adapters"]) == 8
    assert "still exactly zero" in f.message
    if case == "flushed":
        g = found["adapter_grads_flushed"]
        assert g.evidence["share"] == 1.0 and g.evidence["keep_scale"] > 2.0 ** -30


def test_the_adapter_gradient_and_learning_rate_multipliers(base, tmp_path):
    """A mode's `train:` overrides (the source's remedies): adapter_grad_multiplier scales the adapters' unscaled
    gradients before the optimizer (x8, exact in FP32: the first step's largest adapter gradient is 8 times the
    plain run's); adapter_lr_multiplier gives the adapters their own parameter group at k times the rate."""
    results = base[0]
    dyn = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    s = study(results, **{"fp16-dynamic": dyn, "fp16-x8": {**dyn, "train": {"adapter_grad_multiplier": 8}},
                          "fp16-lr10": {**dyn, "train": {"adapter_lr_multiplier": 10}}})
    for family in s["models"].values():
        family.setdefault("train", {})["max_steps"] = 1
    s["models"]["lm_base"]["train"]["max_steps"] = 10  # the base is the module's (resolve_run only reads it)
    amax = {m: pd.read_csv(run(s, "lm_lora", m, results, tmp_path)[1] / "adapters.csv")
            .set_index("adapter")["grad_amax"]
            for m in ("fp16-dynamic", "fp16-x8")}
    assert ((amax["fp16-x8"] / amax["fp16-dynamic"]) == 8).all()
    cfg = resolve_run(s, "lm_lora", "fp16-lr10", 0)
    from lab.run.optim import build_optimizer, param_groups
    model = cfg.model.build(1024, 0, 32, "fp16")
    opt = build_optimizer(cfg, param_groups(cfg, model))
    assert [g["lr"] for g in opt.param_groups] == [cfg.train.lr * 10]  # every trainable parameter is an adapter
    assert resolve_run(s, "lm_lora", "fp16-dynamic", 0).hash() != cfg.hash()


def test_fp16_adapters_are_refused_before_the_first_step(base, tmp_path):
    """finetune.adapter_dtype: base puts the adapters in FP16 with their base (peft's autocast_adapter_dtype=False):
    the run stops before its first step, naming the fix, and leaves no step behind."""
    results = base[0]
    s = study(results, **{"fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}})
    s["models"]["lm_lora"]["finetune"]["adapter_dtype"] = "base"
    cfg = resolve_run(s, "lm_lora", "fp16-dynamic", 0)
    model = cfg.model.build(1024, 0, 32, "fp16")
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float16}  # really FP16 adapters
    from lab.scaling.adapters import TrainableDtypeError
    with pytest.raises(TrainableDtypeError, match="autocast_adapter_dtype=True"):
        train(cfg, tmp_path / "run", progress=io.StringIO())
    assert not (tmp_path / "run" / "steps.csv").exists()


def test_a_killed_finetune_resumes_to_the_same_steps_and_adapter_log(base, tmp_path):
    """No fine-tune is lost: SIGKILL mid-run (tests/resume_driver.py), the same call resumes from the checkpoint, and
    steps.csv, census.csv, adapters.csv and metrics.json (timing aside) equal the uninterrupted run's."""
    import re
    import subprocess
    import sys

    from lab.run import checkpoint
    results = base[0]
    s = study(results, **{"fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}})
    s["models"]["lm_lora"].setdefault("train", {}).update(max_steps=12, checkpoint_every=2)
    cfg = resolve_run(s, "lm_lora", "fp16-dynamic", 0)
    train(cfg, tmp_path / "ref", progress=io.StringIO())
    spec = json.dumps({"study": s, "model": "lm_lora", "mode": "fp16-dynamic", "seed": 0,
                       "out": str(tmp_path / "run"), "kill": "micro:9"})
    done = subprocess.run([sys.executable, str(REPO / "tests" / "resume_driver.py"), spec], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    log = io.StringIO()
    train(cfg, tmp_path / "run", progress=log)
    assert re.search(r"resuming from \S+ \(step [1-9]", log.getvalue())
    assert not checkpoint.folder(tmp_path / "run").exists()
    for name in ("steps.csv", "census.csv", "adapters.csv"):
        assert (tmp_path / "run" / name).read_text() == (tmp_path / "ref" / name).read_text(), name
    timing = {"wall_s", "train_time_s", "throughput_samples_per_s", "peak_memory_mb"}
    ref, got = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ref", "run"))
    assert {k: v for k, v in got.items() if k not in timing} == {k: v for k, v in ref.items() if k not in timing}


def test_a_local_hugging_face_folder_is_a_base_model(tmp_path):
    """finetune.base_model: a local Hugging Face folder (here a tiny GPT-2 saved with save_pretrained, its tokenizer's
    vocab.json/merges.txt beside it, as a downloaded gpt2 folder holds them): the data prepared with that tokenizer
    (prepare-text --gpt2-files), the model loaded in FP16 for an FP16 mode, FP32 adapters on c_attn, trained."""
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from lab.data import tokens
    from lab.data.text import pydoc_documents
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(text for _, text in pydoc_documents()[:20]))
    trained = tmp_path / "bpe"
    tokens.prepare(corpus, trained, vocab_size=300, val_fraction=0.1, log=lambda m: None)
    folder = tmp_path / "gpt2-tiny"
    folder.mkdir()
    Tokenizer.from_file(str(trained / "tokenizer.json")).model.save(str(folder))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    data = tmp_path / "tokens"
    tokens.prepare(corpus, data, gpt2_files=str(folder), val_fraction=0.1, log=lambda m: None)
    s = copy.deepcopy(FINETUNE)
    s.update(results_dir=str(tmp_path / "results"), device="cpu", seeds=[0])
    s["data"] = {"name": "tokens", "path": str(data), "vocab_size": 300, "context": 16}
    s["train"].update(batch_size=8, max_steps=4, log_every=2, census_every=2)
    s["models"] = {"gpt2_lora": {"preset": "hf-causal-lm", "modes": ["fp16-dynamic"],
                                 "finetune": {"base_model": str(folder), "targets": ["c_attn"], "rank": 4}}}
    s = validate_study(s)
    cfg = resolve_run(s, "gpt2_lora", "fp16-dynamic", 0)
    model = cfg.model.build(300, 0, 16, "fp16")
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    metrics = train(cfg, tmp_path / "run", progress=io.StringIO())
    assert metrics["status"] == "ok" and metrics["steps"] == 4 and metrics["base_model"]["base_dtype"] == "float16"
    assert metrics["base_model"]["base_model"] == str(folder) and len(metrics["base_model"]["weights_sha256"]) == 64
    adapters = pd.read_csv(tmp_path / "run" / "adapters.csv")["adapter"].unique().tolist()
    assert adapters == ["lm.transformer.h.0.attn.c_attn"]
    gpu = yaml.safe_load((REPO / "configs" / "finetune-gpu.yaml").read_text())  # the GPU config, paths pointed here
    gpu["data"]["path"] = str(data)
    gpu["models"]["gpt2_lora"]["finetune"]["base_model"] = str(folder)
    assert {m for m in validate_study(gpu)["modes"]} >= {"fp32", "fp16-dynamic", "fp16-dynamic-gradx10"}
    bad = copy.deepcopy(s)
    bad["models"]["gpt2_lora"]["finetune"]["base_model"] = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="finetune.base_model: expected a local Hugging Face model folder"):
        validate_study(bad)
    del bad["models"]["gpt2_lora"]["finetune"]["targets"]
    with pytest.raises(ConfigError, match=r"finetune.targets: expected the names .* \[c_attn\] for GPT-2"):
        validate_study(bad)

"""configs/imagenet-1day.yaml: it validates against the schema, and its GPU-hour arithmetic
(configs/budgets/imagenet-1day.yaml, benchmarks/calibration/recipe_budget.py) adds up and is what its comments quote."""

import json
import re

import pytest
import yaml

from conftest import REPO, load_benchmark
from lab.core.config import ConfigError, load_study, resolve_run
from lab.core.study import study_runs

CONFIG = REPO / "configs" / "imagenet-1day.yaml"
BUDGET = REPO / "configs" / "budgets" / "imagenet-1day.yaml"


def test_config_validates_with_local_data_paths(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):  # ships pointing at /data/imagenet and /data/text
        load_study([CONFIG])
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({"data": {"path": str(tmp_path)},
                                     "models": {"lm": {"data": {"path": str(tmp_path)}}}}))
    study = load_study([CONFIG, local])
    assert set(study["models"]) == {"resnet50", "mobilenetv2", "vit", "lm"}
    assert [study["models"][m]["preset"] for m in ("resnet50", "mobilenetv2", "vit", "lm")] == [
        "resnet50", "mobilenetv2_100", "vit_small_patch16", "gpt2-small"]
    # the modes the source study's claims are about, and every one of them here (the lab's own claims about its
    # policies, e.g. amax-history, are the CPU study's)
    source_claims = [c for c in yaml.safe_load((REPO / "configs" / "claims.yaml").read_text())["claims"]
                     if c["source"].startswith("source study")]
    claimed = set(re.findall(r"'mode': '([\w.+-]+)'", repr(source_claims)))
    assert "fp16-dynamic" in claimed and "fp16-static128" in claimed
    assert set(study["modes"]) == {"fp32", "fp16-noscale", "fp16-static128", "fp16-static1024", "fp16-dynamic", "bf16"}
    assert claimed <= set(study["modes"])
    assert len(study_runs(study)) == 3 * 6 * 2 + 6 * 3
    for model in ("resnet50", "mobilenetv2", "vit"):
        run = resolve_run(study, model, "fp16-dynamic", 0)
        assert run.train.epochs == 16 and run.data.image_size == 224 and run.data.name == "imagenet"
    lm = resolve_run(study, "lm", "fp32", 2)
    assert lm.data.context == 1024 and lm.data.vocab_size == 50257 and lm.train.label_smoothing == 0.0
    assert lm.train.batch_size * lm.train.accum_steps * lm.data.context == 131072 and lm.train.max_steps == 1500
    assert resolve_run(study, "vit", "fp32", 0).train.optimizer == "adamw"
    assert resolve_run(study, "resnet50", "fp32", 0).train.optimizer == "sgd"


def test_gpu_hour_arithmetic_adds_up_and_is_quoted():
    rb = load_benchmark("calibration/recipe_budget")
    budget = rb.load_budget(BUDGET)
    assert (REPO / budget["config"]) == CONFIG
    plan = rb.plan(BUDGET)
    node = budget["node"]

    # every run of the config is costed, with the hours the budget file and the config's comments state
    assert len(plan["runs"]) == budget["runs"]
    text = CONFIG.read_text()
    for preset, stated in budget["hours_per_run"].items():
        computed = plan["per_preset"][preset]
        assert computed == {"fp32": {stated["fp32"]}, "amp": {stated["amp"]}}, preset
        for hours in stated.values():
            assert f"{hours:.2f} GPU-h" in text, (preset, hours)
    assert round(plan["total_gpu_hours"], 1) == budget["total_gpu_hours"]
    assert round(plan["makespan_hours"], 1) == budget["makespan_hours"]
    assert f"{budget['total_gpu_hours']} GPU-h" in text and f"{budget['makespan_hours']} h" in text

    # and it fits the day: within the node's GPU-hours, and packed onto its GPUs with the headroom left over
    assert plan["total_gpu_hours"] <= node["gpus"] * node["hours"]
    assert plan["makespan_hours"] <= (1 - budget["headroom"]) * node["hours"]
    assert max(r["hours"] for r in plan["runs"]) <= plan["makespan_hours"]

    # the arithmetic itself, by hand for one run of each kind
    resnet_fp32 = next(r for r in plan["runs"] if r["preset"] == "resnet50" and r["precision"] == "fp32")
    rate = 367 * 19.5 / 15.7  # the V100 figure at the A100's FP32 peak (same model, same FLOPs)
    assert resnet_fp32["samples_per_s"] == pytest.approx(rate)
    assert resnet_fp32["hours"] == pytest.approx(16 * (1281167 + 50000 * 0.3333) / rate / 3600)
    lm_amp = next(r for r in plan["runs"] if r["preset"] == "gpt2-small" and r["precision"] == "bf16")
    assert lm_amp["hours"] == pytest.approx((1500 * 131072 + 0.3333 * 0.01 * 250e6) / 106667 / 3600)
    assert 106667 == round(600000 * 12 * 1024 * 40 / (4 * 86400) / 8)  # nanoGPT: 300B tokens, 4 days, 8 GPUs
    mobilenet = next(r for r in plan["runs"] if r["preset"] == "mobilenetv2_100" and r["precision"] == "fp16")
    loader = budget["loader"]["workers"] * budget["loader"]["images_per_s_per_worker"]
    assert mobilenet["bound"] == "gpu" and mobilenet["samples_per_s"] < loader
    assert rb.pack([3, 5, 3, 4, 3], 2) == 10  # longest first: 5, 4, 3 -> second (7), 3 -> first (8), 3 -> second


def test_measured_throughput_replaces_the_published_figures(tmp_path):
    rb = load_benchmark("calibration/recipe_budget")
    report = {"rows": [
        {"preset": "resnet50", "precision": "fp32", "scaler": "none", "status": "ok", "samples_per_s": 900.0},
        {"preset": "resnet50", "precision": "tf32", "scaler": "none", "status": "ok", "samples_per_s": 1500.0},
        {"preset": "resnet50", "precision": "fp16", "scaler": "torch.amp.GradScaler", "status": "ok",
         "samples_per_s": 3000.0},
        {"preset": "resnet50", "precision": "fp16", "scaler": "lab.scaling dynamic", "status": "ok",
         "samples_per_s": 2990.0},
        {"preset": "resnet50", "precision": "bf16", "scaler": "none", "status": "oom", "samples_per_s": None}]}
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(report))
    measured = rb.measured_rates(path)
    assert measured == {"resnet50": {"fp32": 900.0, "fp16": 3000.0}}
    published, mine = rb.plan(BUDGET), rb.plan(BUDGET, measured)

    def hours(p, precision):
        return next(r["hours"] for r in p["runs"] if r["preset"] == "resnet50" and r["precision"] == precision)
    assert hours(mine, "fp32") == pytest.approx(hours(published, "fp32") * (367 * 19.5 / 15.7) / 900)
    assert hours(mine, "fp16") == pytest.approx(hours(published, "fp16") * 2470 / 3000)
    assert hours(mine, "bf16") == hours(published, "bf16")  # not measured: the published figure stays

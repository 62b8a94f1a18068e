"""QLoRA (finetune.base_quant: nf4, lab/models/nf4.py): the base's linear layers as torchao's NF4 tensors under FP32
adapters. Against torchao itself: the layer is torchao's NF4Tensor and linear_nf4 (in FP32 exactly; under FP16 and
BF16 autocast torchao's linear_nf4 computed in FP32 on the rounded operands and rounded once, the tensor-core
contract), bit for bit. The recorded loop equals the plain one bit for bit; the evaluation precisions
(train.eval_precision) leave training untouched; `lab diagnose` reads a QLoRA run."""
import copy
import io
import json

import pandas as pd
import pytest
import torch
import yaml

import lab
import lab.scaling
from conftest import REPO
from lab.cli import main
from lab.core.config import ConfigError, resolve_run, validate_study
from lab.models.lora import cast_to, widened_to_fp32
from lab.models.nf4 import NF4Linear, nf4_storage, scaler_block_size
from lab.numerics.contract import tensor_core_contract
from lab.run.train import train

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
FINETUNE = yaml.safe_load((REPO / "configs" / "finetune.yaml").read_text())
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def study(results, **modes):
    """finetune.yaml cut down, with lm_qlora (the same adapters over the NF4 base) beside lm_lora."""
    s = copy.deepcopy(FINETUNE)
    s.update(results_dir=str(results), device="cpu", seeds=[0])
    s["train"].update(batch_size=8, max_steps=12, log_every=4, census_every=5)
    s["models"]["lm_base"]["train"] = {"max_steps": 10}
    s["models"]["lm_lora"]["modes"] = ["fp32", *modes]
    s["models"]["lm_qlora"] = copy.deepcopy(s["models"]["lm_lora"])
    s["models"]["lm_qlora"]["finetune"]["base_quant"] = "nf4"
    s["modes"].update(modes)
    return validate_study(s)


DYNAMIC = {"fp16-dynamic": {"precision": "fp16", "scaler": {"policy": "dynamic"}}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    results = tmp_path_factory.mktemp("qlora")
    train(resolve_run(study(results), "lm_base", "fp32", 0), results / "runs" / "lm_base" / "fp32" / "seed0",
          progress=io.StringIO())
    return results


def test_the_layer_holds_torchaos_nf4_tensor():
    """The weight is the NF4Tensor to_nf4 makes of the same weight (its codes, scales and table, bit for bit), the
    scales' block the largest power of two <= 256 dividing the blocks; the state_dict plain tensors only."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 192).half()
    layer = NF4Linear(linear)
    assert layer.scaler_block_size == 64 == scaler_block_size(192) and scaler_block_size(256) == 256
    direct = nf4_tensor.to_nf4(linear.weight.detach(), 64, 64)
    w = layer.weight
    assert isinstance(w, nf4_tensor.NF4Tensor) and w.dtype == torch.float16 and w.shape == (192, 64)
    for name in direct.__tensor_flatten__()[0]:
        assert torch.equal(getattr(w, name), getattr(direct, name)), name
    assert torch.equal(w.get_original_weight(), direct.get_original_weight())
    assert all(type(v) is torch.Tensor for v in layer.state_dict().values())
    again = NF4Linear(torch.nn.Linear(64, 192).half())
    again.load_state_dict(layer.state_dict())
    assert torch.equal(again.weight.get_original_weight(), w.get_original_weight())
    with pytest.raises(ValueError, match="not a whole number of NF4 blocks of 64"):
        NF4Linear(torch.nn.Linear(10, 3))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("path", ["autocast", "stored-low-precision"])
def test_the_forward_and_input_gradient_are_torchaos_linear_nf4_under_the_contract(precision, path):
    """Under CPU autocast (and on FP16/BF16 inputs outside it), the NF4 layer computes torchao's linear_nf4 in FP32
    on the rounded operands, each result rounded once, the bias added to the rounded output as torchao's F.linear
    adds it: the forward and the input gradient equal that bit for bit."""
    dtype = LOW[precision]
    torch.manual_seed(1)
    layer = NF4Linear(torch.nn.Linear(64, 256).to(dtype))
    x = torch.randn(4, 16, 64) * 3
    if path == "autocast":
        x.requires_grad_()
        with lab.autocast("cpu", dtype):
            y = layer(x)
    else:
        x = x.to(dtype).requires_grad_()
        with tensor_core_contract():
            y = layer(x)
    cot = torch.randn(y.shape).to(dtype)
    gx, = torch.autograd.grad(y, x, cot)
    xr = x.detach().to(dtype).float().requires_grad_()
    ref32 = nf4_tensor.linear_nf4(xr, layer.weight)  # torchao's own function, in FP32
    ref = ref32.to(dtype) + layer.bias
    gref, = torch.autograd.grad(ref32, xr, cot.float())
    assert y.dtype == dtype and torch.equal(y, ref)
    assert torch.equal(gx, gref.to(dtype).to(gx.dtype))


def test_in_fp32_the_layer_is_torchaos_path_itself():
    torch.manual_seed(2)
    layer = NF4Linear(torch.nn.Linear(64, 128))
    x = torch.randn(8, 64, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, nf4_tensor.linear_nf4(x, layer.weight) + layer.bias)


def test_the_qlora_model_its_record_and_a_bad_setting(base):
    s = study(base, **DYNAMIC)
    cfg = resolve_run(s, "lm_qlora", "fp16-dynamic", 0)
    assert cfg.model.finetune["base_quant"] == "nf4" and "base_quant" not in resolve_run(
        s, "lm_lora", "fp16-dynamic", 0).model.finetune  # recorded in the resolved config; an FP16 base's unchanged
    model = cfg.model.build(1024, 0, 32, "fp16")
    quantized = [n for n, m in model.named_modules() if isinstance(m, NF4Linear)]
    assert len(quantized) == 8 and all(n.endswith("base_layer") for n in quantized)  # every block linear, adapted
    inner = model.base_model.model
    assert type(inner.head) is torch.nn.Linear and inner.head.weight is inner.tok.weight  # the tied head stays
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}
    assert model.lab_base["base_quant"]["method"] == "nf4" and model.lab_base["base_quant"]["block_size"] == 64
    bad = copy.deepcopy(s)
    bad["models"]["lm_qlora"]["finetune"]["base_quant"] = "nf3"
    with pytest.raises(ConfigError, match=r"finetune.base_quant: expected one of none, nf4; found 'nf3'"):
        validate_study(bad)


def test_the_fp32_replay_and_the_evaluation_casts_leave_the_codes_alone():
    """widened_to_fp32 (the census's FP32 replay) and cast_to (fp16-full evaluation) never cast the NF4 storage: the
    weight dequantizes to the same values (FP16 values widened exactly), and every tensor comes back bit for bit."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(NF4Linear(torch.nn.Linear(64, 64).half()), torch.nn.Linear(64, 8))
    keep = {id(t): t.clone() for t in [*model.parameters(), *model.buffers()]}
    w16 = model[0].weight.get_original_weight()
    with widened_to_fp32(model):
        assert model[0].nf4_nf4.dtype == torch.float16 and model[0].bias.dtype == torch.float32
        assert torch.equal(model[0].weight.to(torch.float32), w16.float())
    with cast_to(model, torch.float16):
        assert model[1].weight.dtype == torch.float16 and model[0].nf4_scaler_mean.dtype == torch.float16
    assert len(nf4_storage(model)) == 5
    for t in [*model.parameters(), *model.buffers()]:
        assert t.dtype == keep[id(t)].dtype and torch.equal(t, keep[id(t)])


def _qlora(base, precision="fp16"):
    torch.manual_seed(0)  # peft draws lora_A's initial values
    s = study(base, **DYNAMIC)
    return resolve_run(s, "lm_qlora", "fp16-dynamic", 0).model.build(1024, 0, 32, precision)


def _loop(model, steps, rec=None):
    """A hand-written FP16 loop (lab.autocast, the lab's dynamic scaler, AdamW over the adapters): per-step losses."""
    torch.manual_seed(4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    scaler = lab.scaling.create("dynamic", device="cpu")
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 1024, (8, 33), generator=g) for _ in range(steps)]
    current, losses = {}, []

    def loss_of(batch):
        with lab.autocast("cpu", torch.float16):
            logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 1024), batch[:, 1:].reshape(-1))

    def replay():
        scaler.scale(loss_of(current["batch"])).backward()

    if rec is not None:
        rec = lab.record(model, scaler, out=rec, optimizer=opt, replay=replay, census_every=3, log_every=2)
    for batch in data:
        current["batch"] = batch
        loss = loss_of(batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if rec is not None:
            rec.step(loss)
        losses.append(loss.detach())
        opt.zero_grad(set_to_none=True)
    if rec is not None:
        rec.close()
    return losses


def test_a_recorded_qlora_loop_equals_the_unrecorded_one_bit_for_bit(base, tmp_path):
    """lab.record over the NF4 base (its census with FP32 replays, its adapters.csv) changes nothing: the same losses
    and the same adapter weights, bit for bit; the run folder is a lab run `lab diagnose` reads."""
    plain, recorded = _qlora(base), _qlora(base)
    a, b = _loop(plain, 8), _loop(recorded, 8, rec=tmp_path / "rec")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    adapters = [(n, p) for n, p in plain.named_parameters() if p.requires_grad]
    assert adapters and all(torch.equal(p, dict(recorded.named_parameters())[n]) for n, p in adapters)
    assert all(torch.equal(x, y) for x, y in zip(plain.state_dict().values(), recorded.state_dict().values()))
    m = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert m["census_steps"] >= 2 and m["flushed_adapter"] is not None and m["adapter_grad_mean_abs"] > 0
    assert main(["diagnose", str(tmp_path / "rec")]) == 0


def test_a_qlora_run_trains_records_resumes_and_is_diagnosed(base, tmp_path, capsys):
    """The lab's loop over the NF4 base: metrics.json records the quantization and the adapters' mean absolute
    gradient (the mean of adapters.csv's regular rows); `lab diagnose RUN` reads the run."""
    s = study(base, **DYNAMIC)
    metrics = train(resolve_run(s, "lm_qlora", "fp16-dynamic", 0), tmp_path / "run", progress=io.StringIO())
    assert metrics["status"] == "ok" and metrics["base_model"]["base_quant"]["dequantized_to"] == "float16"
    rows = pd.read_csv(tmp_path / "run" / "adapters.csv")
    assert metrics["adapter_grad_mean_abs"] == pytest.approx(rows[rows["step"] % 4 == 0]["grad_mean_abs"].mean(),
                                                             rel=1e-12)
    assert (rows["b_norm"] > 0).all()
    assert main(["diagnose", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "lm_qlora / fp16-dynamic" in out and "adapter grads" in out


def test_a_killed_qlora_run_resumes_to_the_same_run(base, tmp_path):
    """Its checkpoint holds the NF4 codes as plain tensors (weights_only=True loads them): killed mid-run and
    resumed, steps.csv, census.csv and adapters.csv equal the uninterrupted run's."""
    import subprocess
    import sys
    s = study(base, **DYNAMIC)
    s["models"]["lm_qlora"].setdefault("train", {}).update(checkpoint_every=2)
    cfg = resolve_run(s, "lm_qlora", "fp16-dynamic", 0)
    train(cfg, tmp_path / "ref", progress=io.StringIO())
    spec = json.dumps({"study": s, "model": "lm_qlora", "mode": "fp16-dynamic", "seed": 0,
                       "out": str(tmp_path / "run"), "kill": "micro:9"})
    done = subprocess.run([sys.executable, str(REPO / "tests" / "resume_driver.py"), spec], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    log = io.StringIO()
    train(cfg, tmp_path / "run", progress=log)
    assert "resuming from" in log.getvalue()
    for name in ("steps.csv", "census.csv", "adapters.csv"):
        assert (tmp_path / "run" / name).read_text() == (tmp_path / "ref" / name).read_text(), name


@pytest.mark.parametrize("family", ["lm_lora", "lm_qlora"])
def test_the_evaluation_precisions_score_a_cast_copy_and_leave_training_untouched(base, tmp_path, family):
    """train.eval_precision: fp16-full scores the model cast to FP16 (a .half() copy under the contract's stored
    path), fp32 the model widened to FP32 without autocast; either way training is the same bit for bit (steps.csv
    and adapters.csv: 27 steps an epoch, so an evaluation runs mid-training), since the evaluation puts every tensor
    back."""
    from lab.run.evaluation import evaluate
    s = study(base, **DYNAMIC, **{
        "fp16-evalfp16": {**DYNAMIC["fp16-dynamic"], "train": {"eval_precision": "fp16-full"}},
        "fp16-evalfp32": {**DYNAMIC["fp16-dynamic"], "train": {"eval_precision": "fp32"}}})
    s["train"].update(batch_size=64, max_steps=30)
    runs = {m: tmp_path / m for m in ("fp16-dynamic", "fp16-evalfp16", "fp16-evalfp32")}
    metrics = {m: train(resolve_run(s, family, m, 0), d, progress=io.StringIO()) for m, d in runs.items()}
    assert metrics["fp16-dynamic"]["epochs"] == 2  # evaluated after step 27 and at the end
    for m in ("fp16-evalfp16", "fp16-evalfp32"):
        for name in ("steps.csv", "adapters.csv"):
            assert (runs[m] / name).read_text() == (runs["fp16-dynamic"] / name).read_text(), (m, name)
    # the final weights (the fp16-dynamic run's, trained again) scored from cast copies
    cfg = resolve_run(s, family, "fp16-dynamic", 0)
    bundle = cfg.data.build()
    from lab.data.datasets import make_loader
    from lab.run.evaluation import eval_batch_size
    size = eval_batch_size(bundle.task, bundle.num_classes, bundle.input_size, cfg.train.batch_size)
    loader = make_loader(bundle.val, size, shuffle=False, seed=0)
    model = _trained(cfg, bundle, tmp_path / "again")
    with torch.no_grad():
        half = copy.deepcopy(model)
        for t in [*half.parameters(), *half.buffers()]:
            if t.is_floating_point() and id(t) not in nf4_storage(half):
                t.data = t.data.half()
        with tensor_core_contract():
            got = evaluate(half, loader, "cpu", "fp32", prepare=bundle.prepare)[1]
        assert got == metrics["fp16-evalfp16"]["final_val_loss"]
        wide = copy.deepcopy(model)
        for t in [*wide.parameters(), *wide.buffers()]:
            if t.dtype == torch.float16 and id(t) not in nf4_storage(wide):
                t.data = t.data.float()
        got = evaluate(wide, loader, "cpu", "fp32", prepare=bundle.prepare)[1]
        assert got == metrics["fp16-evalfp32"]["final_val_loss"]


def _trained(cfg, bundle, out):
    """The run trained again, its final model kept (the loop's own)."""
    from lab.run import checkpoint, distributed
    from lab.run.process import seed_everything, set_fp32_reductions, set_true_fp32
    from lab.run.train import build_loop
    d = distributed.from_env("cpu")
    out.mkdir()
    set_true_fp32("cpu"), set_fp32_reductions()
    seed_everything(cfg.seed)  # as train() starts a run
    with checkpoint.SignalFlag() as signals:
        loop = build_loop(cfg, bundle, out, out, "cpu", io.StringIO(), d, [], signals)
        loop.run()
    return loop.model


def test_what_cannot_be_quantized_or_evaluated_so_is_refused_by_name(tmp_path):
    """A base with no untied nn.Linear (GPT-2's Conv1D, a head tied to its embedding) has nothing for nf4 to
    quantize; train.eval_precision under FSDP (sharded weights) is refused before any job."""
    from lab.models.nf4 import NF4Error, quantize_nf4
    tied = torch.nn.Module()
    tied.tok, tied.head = torch.nn.Embedding(16, 64), torch.nn.Linear(64, 16, bias=False)
    tied.head.weight = tied.tok.weight
    with pytest.raises(NF4Error, match="no nn.Linear layer of its own to quantize"):
        quantize_nf4(tied)
    from conftest import tiny_study
    s = tiny_study(parallel="fsdp", processes_per_run=2)
    s["modes"]["fp16-static128"]["train"] = {"eval_precision": "fp16-full"}
    with pytest.raises(ConfigError, match="fp16-static128: train.eval_precision does not run under parallel: fsdp"):
        validate_study(s)
    s["processes_per_run"] = 1
    validate_study(s)

"""The training loop and the run directory it writes."""
import contextlib
import csv
import io
import json
import math
import subprocess
import sys
import types

import torch
import torch.nn.functional as F
import pytest
import yaml

from lab import cli
from lab.core.config import resolve_run, validate_study
from lab.run.train import STEP_FIELDS, train

from conftest import REPO, RUN_DEVICES, count_contract_calls, tiny_study

REQUIRED_METRICS = ["model", "mode", "seed", "device", "fp16_path", "precision", "scaler", "steps", "epochs",
                    "final_top1", "best_top1", "final_train_loss", "overflow_steps", "skipped_steps",
                    "update_ratio", "final_scale", "min_scale", "max_scale", "diverged",
                    "throughput_samples_per_s", "peak_memory_mb", "wall_s", "status"]


def run(tmp_path, mode, mode_def=None, **train_overrides):
    study = tiny_study()
    if mode_def:
        study["modes"][mode] = mode_def
    study["train"].update(train_overrides)
    cfg = resolve_run(validate_study(study), "resnet50", mode, 0)
    out = tmp_path / mode
    metrics = train(cfg, out)
    return metrics, out


def read_steps(out):
    with open(out / "steps.csv") as f:
        return list(csv.DictReader(f))


def test_run_directory_contents(tmp_path, monkeypatch):
    calls = count_contract_calls(monkeypatch)
    metrics, out = run(tmp_path, "fp16-static128")
    assert calls[F.conv2d] > 0 and calls[F.linear] > 0  # the contract label below is the contract at work
    for key in REQUIRED_METRICS:
        assert key in metrics, key
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert metrics["status"] == "ok" and metrics["steps"] == 3 and metrics["fp16_path"] == "cpu-tensor-core-contract"
    rows = read_steps(out)
    assert list(rows[0]) == STEP_FIELDS and len(rows) == metrics["steps"]
    assert all(float(r["scale"]) == 128.0 for r in rows)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["mode"]["scaler"] == {"policy": "static", "scale": 128} and config["seed"] == 0
    prov = json.loads((out / "provenance.json").read_text())
    for key in ("versions", "device_name", "git", "command", "start_time", "end_time", "config_hash"):
        assert key in prov
    assert prov["config_hash"] == metrics["config_hash"]
    assert not list(out.glob("*.tmp")) and not (out / "steps.csv.partial").exists()
    # FP32 reductions as the CPU contract computes them, switched and recorded; autotuning recorded
    assert metrics["fp16_reduced_precision_reduction"] is False is metrics["bf16_reduced_precision_reduction"]
    assert not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    assert metrics["cudnn_benchmark"] is True and metrics["deterministic"] is False


def test_same_seed_same_trajectory(tmp_path):
    _, a = run(tmp_path / "a", "fp32")
    _, b = run(tmp_path / "b", "fp32")
    la = [r["loss"] for r in read_steps(a)]
    assert la == [r["loss"] for r in read_steps(b)]


def test_all_steps_skipped_is_diverged_not_a_crash(tmp_path):
    # scale 2^40 overflows FP16 in every backward pass: every step is skipped
    metrics, out = run(tmp_path, "fp16-huge", {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40}},
                       max_steps=4)
    assert metrics["status"] == "diverged" and metrics["diverged"]
    assert metrics["skipped_steps"] == metrics["steps"] == 4 and metrics["update_ratio"] == 0
    rows = read_steps(out)
    assert all(r["skipped"] == "1" for r in rows)
    # a skipped step never advances the learning-rate schedule
    assert len({r["lr"] for r in rows}) == 1
    assert json.loads((out / "metrics.json").read_text())["status"] == "diverged"


def test_nan_parameters_stop_the_run_as_diverged(tmp_path):
    # no scaling and no skipping: an absurd learning rate drives the weights to inf/nan
    metrics, _ = run(tmp_path, "fp16-noscale", {"precision": "fp16", "scaler": {"policy": "none"}},
                     lr=1e12, max_steps=30, epochs=2, schedule="constant")
    assert metrics["status"] == "diverged"
    assert "non-finite" in metrics["diverged_reason"] or "not finite" in metrics["diverged_reason"]
    assert metrics["steps"] < 30


def test_schedule_advances_only_on_applied_steps(tmp_path):
    metrics, out = run(tmp_path, "fp16-dynamic", {"precision": "fp16", "scaler": {"policy": "dynamic"}},
                       max_steps=6, schedule="onecycle")
    rows = read_steps(out)
    assert metrics["skipped_steps"] >= 1  # 2^16 overflows at first
    applied_before = 0
    lrs_at_applied = {}
    for r in rows:
        lrs_at_applied.setdefault(applied_before, set()).add(r["lr"])
        applied_before += r["skipped"] == "0"
    # every step that follows the same number of applied steps sees the same learning rate
    assert all(len(v) == 1 for v in lrs_at_applied.values())


def test_cli_train_and_errors(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_study()))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lab", "train", "--model", "vit", "--mode", "fp32", "--seed", "1",
           "--out", str(out), "--config", str(cfg), "--set", "train.max_steps=2"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "step 2/2" in res.stdout + res.stderr  # progress is shown
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["seed"] == 1 and metrics["steps"] == 2 and metrics["model"] == "vit"

    # the refusals in this process (lab.cli.main, what `python -m lab` calls: the command above showed the real
    # command's exit path; a subprocess per refusal cost ~4 s of importing torch)
    rc, err = lab_here(cmd[3:7] + ["fp99"] + cmd[8:])
    assert rc == 2 and "unknown mode 'fp99'" in err and "fp16-static128" in err

    missing = tmp_path / "no-such-cifar"
    rc, err = lab_here(cmd[3:] + ["--set", "data.name=cifar10", "--set", f"data.path={missing}",
                                  "--out", str(tmp_path / "run2")])
    assert rc == 2 and str(missing) in err and "it does not exist" in err
    assert not (tmp_path / "run2").exists()  # refused before anything was written


def lab_here(argv) -> tuple[int, str]:
    """`python -m lab ARGV` in this process: exit status, stderr."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, err.getvalue()


def test_a_run_computes_its_config_hash_once(tmp_path, monkeypatch):
    """`lab train` as the workflow's rule runs it (--expect-hash, --threads, --recover-finished), with a checkpoint
    every step: the run's config hash is computed once and carried to the run directory's checks, every
    checkpoint, metrics.json and provenance.json."""
    from lab.core import config
    study = tiny_study()
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(study))
    expected = resolve_run(validate_study(study), "vit", "fp32", 0).hash()
    computed = []
    original = config.config_hash
    monkeypatch.setattr(config, "config_hash", lambda d: computed.append(d) or original(d))
    rc, err = lab_here(["train", "--model", "vit", "--mode", "fp32", "--out", str(tmp_path / "run"),
                        "--config", str(tmp_path / "tiny.yaml"), "--threads", "1", "--expect-hash", expected,
                        "--recover-finished", "--set", "train.checkpoint_every=1"])
    assert rc == 0, err
    assert len(computed) == 1
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    provenance = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert metrics["config_hash"] == provenance["config_hash"] == expected and metrics["steps"] == 3


def test_accumulation_never_spans_epochs(tmp_path, monkeypatch):
    """An epoch's leftover micro-batches (fewer than accum_steps) are not trained on: their gradients would
    otherwise be added to the next epoch's first step."""
    import lab.run.loop as L
    calls = []
    original = L.forward_backward
    monkeypatch.setattr(L, "forward_backward", lambda *a, **k: calls.append(1) or original(*a, **k))
    # digits: 1437 training images in batches of 256 = 5 full batches; accum 2 -> 2 steps, 1 batch left over
    metrics, out = run(tmp_path, "fp32", batch_size=256, accum_steps=2, epochs=2, max_steps=None)
    assert metrics["steps"] == 4 and len(calls) == 8 and metrics["samples_per_step"] == 512


def test_accumulation_longer_than_an_epoch_is_refused(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="train.accum_steps: expected at most the 5 batches of 256 .* found 9"):
        run(tmp_path, "fp32", batch_size=256, accum_steps=9, max_steps=None)
    assert not any(tmp_path.iterdir())  # refused before the run directory was made


def test_bad_output_or_data_leaves_nothing_behind(tmp_path):
    """`python -m lab train` refuses, with one line and exit status 2, before writing anything: an --out that
    is a file, a data path that does not exist."""
    out_file = tmp_path / "taken"
    out_file.write_text("not a folder")
    base = [sys.executable, "-m", "lab", "train", "--model", "resnet50", "--mode", "fp32", "--seed", "0"]
    # in this process (what `python -m lab` calls); the data case below, as a shell sees it (one line on stderr)
    rc, err = lab_here(base[3:] + ["--out", str(out_file)])
    assert rc == 2 and f"run directory {out_file}: expected a folder, found a file" in err
    assert out_file.read_text() == "not a folder"
    missing = tmp_path / "no-such-cifar"
    run_dir = tmp_path / "run"
    bad_data = ["--set", "data.name=cifar10", "--set", f"data.path={missing}"]
    done = subprocess.run(base + ["--out", str(run_dir)] + bad_data, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and str(missing) in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not run_dir.exists(), "a refused run must not leave a run directory"


def test_a_run_directory_being_trained_is_refused_to_a_second_trainer(tmp_path):
    """Two trainers on one run directory would interleave steps and checkpoints: the second is refused."""
    import pytest

    from lab.core import lock
    out = tmp_path / "fp32"  # where run() trains
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lab.core import lock; "
                               f"lock.hold({str(out / '.lock')!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.StudyLocked, match=f"another process \\(pid {holder.pid}\\) is training"):
            run(tmp_path, "fp32")
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    run(tmp_path, "fp32")  # the holder is gone, and with it its lock


def _grads(values):
    params = []
    for v in values:
        p = torch.nn.Parameter(torch.zeros(len(v)))
        p.grad = torch.tensor(v, dtype=torch.float32)
        params.append(p)
    return params


def test_without_grad_clip_the_norm_is_read_and_no_gradient_rewritten():
    """train.grad_clip null: the step's norm (the L2 norm over every gradient, as FP64 computes it) and no write to any
    gradient (clip_grad_norm_ with an infinite max_norm multiplied each by 1 on every step, and by NaN on an overflow
    step); with a max_norm, the same clipping as torch's clip_grad_norm_."""
    from lab.run.loop import EpochLoop
    values = [[3.0, -4.0], [12.0], [1e-3, 2e-3, -5e-4]]
    params = _grads(values)
    versions = [p.grad._version for p in params]
    loop = types.SimpleNamespace(params=params, device="cpu")
    norm = EpochLoop._grad_norm_clipped(loop, None)
    exact = math.sqrt(sum(x * x for v in values for x in v))
    assert abs(float(norm) - exact) <= 1e-6 * exact
    assert [p.grad._version for p in params] == versions  # nothing written
    with_inf = _grads([[1.0, float("inf")], [2.0]])
    EpochLoop._grad_norm_clipped(types.SimpleNamespace(params=with_inf, device="cpu"), None)
    assert with_inf[1].grad.tolist() == [2.0]  # an overflow step's finite gradients stay what they were
    clipped, reference = _grads(values), _grads(values)
    got = EpochLoop._grad_norm_clipped(types.SimpleNamespace(params=clipped, device="cpu"), 1.0)
    want = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    # the loop calls get_total_norm and clip_grads_with_norm_, the two functions clip_grad_norm_ is: the same kernels
    assert torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(clipped, reference))


FAULTS_PER_STEP = """
import resource, sys
import torch
import torch.nn.functional as F
from lab.models.presets import create_model
from lab.numerics.precision import autocast_for
from lab.run.process import keep_freed_memory
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert keep_freed_memory() == {"malloc_keep_freed": True}
model = create_model("gpt-tiny", num_classes=1024, in_chans=1, input_size=32)
x, y = torch.randint(0, 1024, (32, 32)), torch.randint(0, 1024, (1024,))
def step():
    with autocast_for("fp16", "cpu"):
        loss = F.cross_entropy(model(x).reshape(1024, -1), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
for _ in range(6):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_keeping_freed_memory_spares_each_step_its_page_faults():
    """keep_freed_memory (every run calls it): a training step reuses the pages the step before freed instead of
    faulting in fresh ones (glibc's default returns large blocks to the OS). Counted, not timed: minor page faults per
    FP16 step of gpt-tiny, in a fresh process each way."""
    def faults(how):
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, how], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])
    default, kept = faults("default"), faults("keep")
    assert kept < default / 2, (kept, default)


def test_without_grad_clip_no_gradient_is_rewritten(tmp_path, monkeypatch):
    """With train.grad_clip unset the loop computes the norm it logs and rewrites nothing
    (clip_grad_norm_ with max_norm inf would multiply every gradient by 1 each step, and by NaN on an overflow
    step); with it set, the gradients are clipped once per step."""
    calls = []
    real = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: pytest.fail("clip_grad_norm_ called"))
    metrics, out = run(tmp_path, "fp16-static128", grad_clip=None)
    assert calls == [] and all(math.isfinite(float(r["grad_norm"])) for r in read_steps(out))
    metrics, out = run(tmp_path / "clipped", "fp16-static128", grad_clip=0.5)
    assert len(calls) == metrics["steps"]


@pytest.mark.parametrize("device", RUN_DEVICES)
def test_tiny_runs_on_each_device(tmp_path, device):
    """`lab train`'s tiny runs on every device the machine has (`pytest -k cuda` on a GPU: CUDA autocast and
    GradScaler-equivalent scaling, with the census, its FP32 replay and an overflow's attribution replay)."""
    from lab.run.train import FP16_PATH_CUDA
    study = tiny_study(device=device)
    study["modes"]["dyn"] = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0**24}}
    study["train"].update(max_steps=12, census_every=4)
    for mode in ("fp32", "dyn"):
        m = train(resolve_run(validate_study(study), "resnet50", mode, 0), tmp_path / mode)
        assert m["status"] == "ok" and m["device"] == device and m["steps"] == 12
    assert m["overflow_steps"] >= 1 and m["fp16_path"] == (FP16_PATH_CUDA if device == "cuda"
                                                          else "cpu-tensor-core-contract")
    assert m["memory_kind"] == ("cuda_max_allocated" if device == "cuda" else "cpu_peak_rss")

"""Checkpoints and exact resume (lab/run/checkpoint.py, lab/run/train.py): a run killed with SIGKILL at a chosen place
and resumed ends with steps.csv, census.csv, grad_hist.csv and metrics.json identical (timing aside) to the
same run uninterrupted. The kills happen in a process of its own (tests/resume_driver.py, forked: drive) at: a
micro-batch inside an epoch, right after a skipped step, during the FP32 fallback, between the last step and the
evaluation, and while a checkpoint is being written; SIGTERM (a scheduler's warning) saves a checkpoint and stops."""
import io
import json
import os
import re
import shutil
import sys
import traceback
import types

import pytest

from lab.core.config import resolve_run, validate_study
from lab.run import checkpoint
from lab.run.train import RunDirError, train

import resume_driver
from conftest import tiny_study

TIMING = {"wall_s", "train_time_s", "throughput_samples_per_s", "peak_memory_mb"}
MODES = {
    "dynamic-skips": {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 2.0 ** 40,
                                                      "backoff_factor": 2.0 ** -10}},
    "fallback": {"precision": "fp16", "scaler": {"policy": "static", "scale": 2.0 ** 40,
                                                 "fp32_fallback_after": 2}},
    # an FP8 recipe whose state is its amax histories (lab/fp8/state.py): the ResNet's classifier converted
    "fp8-delayed": {"precision": "bf16", "recipe": {"name": "fp8-delayed", "history_len": 4, "keep_high": []}},
}


def study(mode: str, **data) -> dict:
    s = tiny_study()
    # 8x8 inputs (the digits' own size; tiny_study's 16 costs ~1.7x the CPU time per run): what is tested is the
    # loop's and the checkpoint's state, the same at any input size (the skips and the fallback happen at 2^40
    # whatever the size: test_fallback_really_happened_and_skips_are_in_the_reference)
    s["data"]["image_size"] = 8
    s["data"].update(data)
    s["modes"] = {mode: MODES[mode]}
    # 11 batches of 128 per epoch, 2 accumulated: 5 steps an epoch (one batch left over), 2 epochs
    s["train"].update(batch_size=128, accum_steps=2, epochs=2, max_steps=None, log_every=3, census_every=2,
                      checkpoint_every=1)
    return validate_study(s)


def run_files(run_dir) -> dict:
    out = {name: (run_dir / name).read_text() for name in ("steps.csv", "census.csv", "grad_hist.csv")}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    out["metrics"] = {k: v for k, v in metrics.items() if k not in TIMING}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs, once per mode."""
    base = tmp_path_factory.mktemp("reference")
    refs = {}
    for mode in MODES:
        train(resolve_run(study(mode), "resnet50", mode, 0), base / mode)
        refs[mode] = run_files(base / mode)
    return refs


def drive(spec: dict) -> types.SimpleNamespace:
    """tests/resume_driver.py's run, killed at spec["kill"], in a process of its own forked from this one (the lab's
    own jobs fork their seeds from a warm process: lab/run/jobs.py), so the kill ends that process alone; a fresh
    interpreter per kill cost ~5 s of importing torch. Returns its exit status as subprocess gives it (-9: SIGKILL)
    and its stderr, read, as subprocess.run reads it, until every process holding it (data loader workers
    included: they hold the run directory's lock too) has exited."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.dup2(w, 2)
            os.close(w)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            sys.argv = ["resume_driver.py", json.dumps(spec)]
            code = resume_driver.main()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with open(r, "rb") as f:
        err = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    return types.SimpleNamespace(returncode=os.waitstatus_to_exitcode(status), stderr=err)


def killed_then_resumed(tmp_path, mode: str, kill: str, **data) -> tuple[dict, types.SimpleNamespace]:
    run_dir = tmp_path / "run"
    done = drive({"study": study(mode, **data), "model": "resnet50", "mode": mode, "seed": 0, "out": str(run_dir),
                  "kill": kill})
    assert not (run_dir / "metrics.json").exists(), "a killed run must not leave a result"
    log = io.StringIO()
    train(resolve_run(study(mode, **data), "resnet50", mode, 0), run_dir, progress=log)
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", log.getvalue())
    assert resumed and int(resumed.group(1)) > 0, "the run must resume from its checkpoint, not start over"
    assert not checkpoint.folder(run_dir).exists(), "a finished run removes its checkpoint"
    return run_files(run_dir), done


@pytest.mark.parametrize("mode,kill", [
    ("dynamic-skips", "micro:9"),       # a forward inside the first epoch, after a few checkpoints
    ("dynamic-skips", "micro:6"),       # right after step 0, a skipped overflow census step (its 2
                                        # micro-batches, their FP32 census replay and their attribution
                                        # replay are calls 0-5)
    ("fallback", "micro:11"),           # after the FP32 fallback (2 skips at 2^40: calls 0-5 and 6-9; step 2
                                        # in FP32, with no FP32 replay: calls 10-11)
    ("dynamic-skips", "evaluate:2"),    # between the last step and the final evaluation
    ("dynamic-skips", "save:4"),        # while the 4th checkpoint is being written (half a file)
    ("fp8-delayed", "micro:7"),         # after 3 steps: its amax histories hold 3 of their 4 values
])
def test_killed_run_resumes_exactly(tmp_path, reference, mode, kill):
    files, done = killed_then_resumed(tmp_path, mode, kill)
    assert done.returncode == -9, done.stderr[-2000:]  # SIGKILL: nothing ran after it
    for name in ("steps.csv", "census.csv", "grad_hist.csv"):
        assert files[name] == reference[mode][name], name
    assert files["metrics"] == reference[mode]["metrics"]


def test_fallback_really_happened_and_skips_are_in_the_reference(reference):
    assert reference["fallback"]["metrics"]["fallback_step"] is not None
    assert reference["dynamic-skips"]["metrics"]["skipped_steps"] >= 1
    assert reference["dynamic-skips"]["metrics"]["epochs"] == 2 and reference["dynamic-skips"]["metrics"]["steps"] == 10


@pytest.mark.parametrize("kill,status", [("sigterm:5", 128 + 15), ("sigusr1:5", 128 + 10)])
def test_a_schedulers_signal_saves_a_checkpoint_exits_128_plus_signal_and_resumes_exactly(tmp_path, reference,
                                                                                         kill, status):
    """`python -m lab train`'s own exit path (lab/commands/train.py): SIGTERM or SIGUSR1 mid-step, a checkpoint at the
    step's end, exit status 128 + the signal, then the same run resumes to the uninterrupted result."""
    files, done = killed_then_resumed(tmp_path, "dynamic-skips", kill)
    assert done.returncode == status, done.stderr[-2000:]
    assert re.search(r"^resnet50/dynamic-skips/seed0: .*checkpoint written", done.stderr, re.M), done.stderr[-2000:]
    assert files == reference["dynamic-skips"]


def augmented_folder(root):
    """An ImageNet-style folder (train/, val/; 2 classes of 24 noisy images): its training transform draws a
    random crop and flip per image, so a resume that fed a worker other batches would change the data."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 4)):
        for c in ("ant", "bee"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


def test_resume_with_data_loader_workers_is_exact(tmp_path):
    """data.num_workers > 0 with random augmentation: the epoch in progress is reloaded and its used batches
    dropped (docs/reliability.md), so the resumed run equals the uninterrupted one with the same workers."""
    data = dict(name="imagenet", path=str(augmented_folder(tmp_path / "images")), image_size=8, num_workers=2)
    s = study("dynamic-skips", **data)
    s["train"].update(batch_size=8, accum_steps=1, epochs=2, max_steps=None, census_every=0)
    s = validate_study(s)
    train(resolve_run(s, "resnet50", "dynamic-skips", 0), tmp_path / "ref")
    run_dir = tmp_path / "run"
    done = drive({"study": s, "model": "resnet50", "mode": "dynamic-skips", "seed": 0, "out": str(run_dir),
                  "kill": "micro:9"})  # in the first epoch's 6 steps, after a few checkpoints
    assert done.returncode == -9, done.stderr[-2000:]
    log = io.StringIO()
    train(resolve_run(s, "resnet50", "dynamic-skips", 0), run_dir, progress=log)
    assert re.search(r"resuming from \S+ \(step [1-9]", log.getvalue())
    assert run_files(run_dir) == run_files(tmp_path / "ref")


def test_checkpoint_of_another_config_is_refused_naming_both_hashes(tmp_path):
    run_dir = tmp_path / "run"
    drive({"study": study("dynamic-skips"), "model": "resnet50", "mode": "dynamic-skips", "seed": 0,
           "out": str(run_dir), "kill": "micro:7"})  # in step 1, after step 0's checkpoint
    other = study("dynamic-skips")
    other["train"]["lr"] = 1e-4
    cfg = resolve_run(other, "resnet50", "dynamic-skips", 0)
    saved = resolve_run(study("dynamic-skips"), "resnet50", "dynamic-skips", 0).hash()
    before = sorted(p.name for p in run_dir.rglob("*"))
    with pytest.raises(RunDirError) as err:  # the folder's config.yaml says whose run it holds
        train(cfg, run_dir)
    assert saved in str(err.value) and cfg.hash() in str(err.value)
    (run_dir / "config.yaml").unlink()  # as Snakemake deletes a failed job's outputs: the checkpoint remains
    with pytest.raises(checkpoint.CheckpointError) as err:
        train(cfg, run_dir)
    assert saved in str(err.value) and cfg.hash() in str(err.value)
    assert not (run_dir / "metrics.json").exists()
    assert set(before) - {"config.yaml"} <= {p.name for p in run_dir.rglob("*")}, "the checkpoint is kept"
    shutil.rmtree(run_dir)


def test_checkpoint_settings_do_not_change_the_config_hash():
    a = resolve_run(study("dynamic-skips"), "resnet50", "dynamic-skips", 0)
    s = study("dynamic-skips")
    s["train"].update(checkpoint_every=7, checkpoint_minutes=1.5, checkpoint_keep=3)
    assert resolve_run(s, "resnet50", "dynamic-skips", 0).hash() == a.hash()


def test_same_config_and_seed_repeat_exactly(tmp_path, reference):
    """Determinism on one CPU: the same config and seed give the same files (timing aside), and so does
    train.deterministic (PyTorch's deterministic algorithms), which CPU runs do not need."""
    train(resolve_run(study("dynamic-skips"), "resnet50", "dynamic-skips", 0), tmp_path / "again")
    assert run_files(tmp_path / "again") == reference["dynamic-skips"]
    s = study("dynamic-skips")
    s["train"]["deterministic"] = True
    train(resolve_run(s, "resnet50", "dynamic-skips", 0), tmp_path / "deterministic")
    files = run_files(tmp_path / "deterministic")
    ref = reference["dynamic-skips"]
    assert files["metrics"]["deterministic"] is True and ref["metrics"]["deterministic"] is False
    for name in ("steps.csv", "census.csv", "grad_hist.csv"):
        assert files[name] == ref[name], name
    differs = {k for k in ref["metrics"] if files["metrics"][k] != ref["metrics"][k]}
    assert differs == {"deterministic", "cudnn_benchmark", "config_hash"}  # the setting, what it switches, the hash

"""The loss scaler under FSDP2 sharding (lab/scaling/engine.py): two gloo processes, `fully_shard` per layer with FP16
weights (`MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`), each rank holding a shard of every
gradient. The lab's `dynamic` equals torch's `ShardedGradScaler` step for step (scale, skips, parameters), an
overflow planted in one rank's shard only skips the step on both ranks, and every policy runs, the gradient norm
and maximum being the unsharded gradients' (gathered here with full_tensor)."""
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import fresh_thread_pool

STEPS, PLANT_STEP = 8, 3


def _sharded_model(reduce_dtype=torch.float32, keep_replica=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    replica = copy.deepcopy(model).half() if keep_replica else None  # the FP16 weights each rank computes with
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return (model, replica) if keep_replica else model


KINDS = ("ShardedGradScaler", "dynamic", "gradnorm", "amax-history")


def _worker(rank, init_file, out):
    fresh_thread_pool()  # before gloo's threads start
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for kind in KINDS:  # one process group for every kind: the processes' start-up is most of the cost
        _train(rank, kind, out)
    for reduce_dtype in ("fp16", "fp32"):
        _reduction(rank, reduce_dtype, out)
    dist.destroy_process_group()


def _reduction(rank, reduce_dtype, out):
    """One backward of the sharded model with its gradients reduced in reduce_dtype, next to each rank's own FP16
    gradient (an unsharded FP16 replica on the same batch), gathered from both ranks."""
    from lab.run.sharding import REDUCE_DTYPES
    model, replica = _sharded_model(REDUCE_DTYPES[reduce_dtype], keep_replica=True)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    scale = torch.tensor(2.0 ** -16)  # gradients near FP16's bottom, where halving before the sum flushes
    (torch.nn.functional.cross_entropy(model(x).float(), y) * scale).backward()
    (torch.nn.functional.cross_entropy(replica(x.half()).float(), y) * scale).backward()
    mine = [p.grad for p in replica.parameters()]
    both = [[torch.empty_like(t) for _ in range(2)] for t in mine]
    for t, slots in zip(mine, both):
        dist.all_gather(slots, t.contiguous())
    out[("reduce", reduce_dtype, rank)] = {"fsdp": [p.grad.full_tensor().detach().clone() for p in model.parameters()],
                                           "ranks": [[s.clone() for s in slots] for slots in both]}


def _train(rank, kind, out):
    from lab import scaling
    model = _sharded_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    if kind == "ShardedGradScaler":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    else:
        scaler = scaling.create(kind, device="cpu", **({"init_scale": 2.0 ** 10, "growth_interval": 3}
                                                       if kind == "dynamic" else {}))
    g = torch.Generator().manual_seed(rank)  # each rank its own data, as in data-parallel training
    record = []
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == PLANT_STEP and rank == 1:  # an inf in rank 1's shard only: rank 0's local gradients stay finite
            params[0].grad._local_tensor[0, 0] = float("inf")
        scale_used = float(scaler.get_scale())
        scaler.unscale_(opt)
        full = [p.grad.full_tensor() for p in params]  # the unsharded gradients, gathered
        clip_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))  # what clipping sees (DTensor-aware)
        before = [p.full_tensor().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        after = [p.full_tensor() for p in params]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f.double()) for f in full])).item()
        amax = max(f.abs().max().item() for f in full)
        record.append({"scale": scale_used, "skipped": all(torch.equal(a, b) for a, b in zip(after, before)),
                       "norm": norm, "amax": amax, "clip_norm": float(clip_norm),
                       "lab_norm": getattr(scaler, "last_grad_norm", None),
                       "lab_amax": getattr(scaler, "last_grad_amax", None)})
        opt.zero_grad()
    out[(kind, rank)] = {"steps": record, "params": [p.full_tensor().detach().clone() for p in params]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = mp.Manager().dict()
    # forked from this warm process: spawn would import torch and this module again in each rank
    mp.start_processes(_worker, args=(str(tmp_path_factory.mktemp("fsdp") / "init"), out), nprocs=2,
                       start_method="fork")
    return dict(out)


def test_dynamic_equals_sharded_grad_scaler_step_for_step_with_an_inf_in_one_shard(runs):
    out = runs
    ref, lab0, lab1 = out[("ShardedGradScaler", 0)], out[("dynamic", 0)], out[("dynamic", 1)]
    skipped = [s["skipped"] for s in lab0["steps"]]
    assert skipped == [s == PLANT_STEP for s in range(STEPS)]  # the one-shard inf skips the step on rank 0 too
    assert skipped == [s["skipped"] for s in lab1["steps"]] == [s["skipped"] for s in ref["steps"]]
    assert [s["scale"] for s in lab0["steps"]] == [s["scale"] for s in ref["steps"]] == \
        [s["scale"] for s in lab1["steps"]]
    scales = [s["scale"] for s in ref["steps"]]
    pairs = list(zip(scales, scales[1:]))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)  # it grew and backed off
    for a, b in zip(lab0["params"], ref["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["gradnorm", "amax-history"])
def test_policies_that_read_the_norm_or_maximum_see_the_unsharded_gradients(runs, policy):
    """Before: amax-history crashed (.tolist() on a DTensor) and gradnorm failed in sharding propagation. Now each
    rank's shard is reduced: the maximum over ranks, the norm from the sum of the shards' squares."""
    out = runs
    for rank in (0, 1):
        for s in out[(policy, rank)]["steps"]:
            if not math.isfinite(s["norm"]):
                continue  # the planted step
            if policy == "gradnorm":
                assert s["lab_norm"] == pytest.approx(s["norm"], rel=1e-6)   # FP32 accumulation of FP32 values
                assert s["clip_norm"] == pytest.approx(s["norm"], rel=1e-6)
            else:
                assert s["lab_amax"] == s["amax"]  # a maximum is exact
    assert out[(policy, 0)]["steps"] == out[(policy, 1)]["steps"]  # every rank the same numbers


# --- `parallel: fsdp` in the lab's own runs (lab/run/sharding.py) ------------------------------------------------
def _lab_train(tmp_path, study, out, mode, *sets, background=False, torchrun=True):
    """torchrun's two ranks of `python -m lab train`; torchrun=False: forked from this process (conftest)."""
    import os
    import subprocess
    import sys

    import yaml

    from conftest import REPO
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    argv = ["train", "--model", "lm", "--mode", mode, "--seed", "0", "--out", str(out), "--config", str(path),
            *(a for s in sets for a in ("--set", s))]
    if not torchrun:
        from conftest import forked_ranks
        return forked_ranks(argv, 2, {"TMPDIR": str(tmp_path)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lab", *argv]
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_sharded_run_trains_agrees_across_ranks_and_resumes_exactly_after_kill_9(tmp_path):
    """processes_per_run 2 with parallel: fsdp: the LM sharded per block with FP16 weights, both ranks end with the
    same (gathered) parameters and scale trajectory, FP16 gradient reduction is a mode setting, and a run killed with
    SIGKILL (torchrun and both ranks) after its first checkpoint (full state dicts gathered on both ranks) resumes,
    by the same command, to the same steps.csv and census.csv as the uninterrupted run."""
    import json
    import os
    import signal
    import time

    from conftest import tiny_study
    s = tiny_study()
    s.update(processes_per_run=2, parallel="fsdp")
    # the LM (tied head and embedding in the root's unit; no timm to import in each of the 9 processes)
    s["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 16, "vocab_size": 256,
                                                         "val_fraction": 0.1}}}
    dyn = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 1024, "growth_interval": 3}}
    s["modes"] = {"dyn": dyn, "dyn-reduce16": {**dyn, "reduce_dtype": "fp16"}}
    s["train"].update(max_steps=16, epochs=3, census_every=4, log_every=2, batch_size=32, checkpoint_every=6)
    whole = _lab_train(tmp_path, s, tmp_path / "whole", "dyn", torchrun=False)  # the reference
    assert whole.returncode == 0, whole.stderr[-3000:]
    m = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert m["parallel"] == "fsdp" and m["world_size"] == 2 and m["ranks_agree"] and m["reduce_dtype"] == "fp32"
    assert "shard" in m["numerics_view"]
    import numpy as np
    scored = np.load(tmp_path / "whole" / "outcomes.npz")  # each rank scored a slice: gathered, the whole set once
    assert len(scored["correct"]) == m["n_val"]
    assert scored["loss"].astype(np.float64).mean() == pytest.approx(m["final_val_loss"], rel=1e-9)
    cut = tmp_path / "cut"
    run = _lab_train(tmp_path, s, cut, "dyn", background=True)
    deadline = time.monotonic() + 120
    while not list(cut.glob("checkpoint/*.pt")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # torchrun starts each rank in a session of its own: kill -9 every process of the tree, ranks first
    import psutil
    tree = psutil.Process(run.pid).children(recursive=True)
    for p in tree:
        p.send_signal(signal.SIGKILL)
    os.killpg(run.pid, signal.SIGKILL)
    run.communicate(timeout=120)
    assert not (cut / "metrics.json").exists() and list(cut.glob("checkpoint/*.pt"))
    resumed = _lab_train(tmp_path, s, cut, "dyn")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]
    for name in ("steps.csv", "census.csv"):
        assert (cut / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    from lab.cli import main
    from lab.diagnose import diagnose
    assert diagnose(cut).steps == 16 and main(["replay", str(cut), "--policy", "dynamic"]) == 0  # they read it
    from lab.core.config import resolve_run, validate_study
    r16 = resolve_run(validate_study(s), "lm", "dyn-reduce16", 0)  # a run of its own (the hash says so)
    assert r16.mode.reduce_dtype == "fp16" and r16.hash() != resolve_run(validate_study(s), "lm", "dyn", 0).hash()


@pytest.mark.parametrize("reduce_dtype", ["fp16", "fp32"])
def test_the_reduction_model_is_fsdp2s_own(runs, reduce_dtype):
    """lab.run.sharding.reduce_like_fsdp (FSDP2's pre-division, sum and post-division in reduce_dtype) gives the
    gradient FSDP2 itself reduced, bit for bit, from the two ranks' own FP16 gradients; and at a small scale the FP16
    reduction flushes values the FP32 one keeps (what reduction_census counts)."""
    from lab.run.sharding import reduce_like_fsdp, reduction_census
    got = runs[("reduce", reduce_dtype, 0)]
    assert [torch.equal(a, b) for a, b in zip(got["fsdp"], runs[("reduce", reduce_dtype, 1)]["fsdp"])] == [True] * 4
    for fsdp, ranks in zip(got["fsdp"], got["ranks"]):  # two ranks: divisions and one addition, each correctly rounded
        assert torch.equal(fsdp.float(), reduce_like_fsdp(ranks, reduce_dtype).float())
    if reduce_dtype == "fp16":
        census = [reduction_census(ranks) for ranks in got["ranks"]]
        assert sum(c["fp16_flushed"] for c in census) > sum(c["fp32_flushed"] for c in census) == 0


def test_the_gpu_fsdp_config_validates_and_its_arithmetic_adds_up():
    """configs/lm-fsdp.yaml (its data path pointed at pydoc here): the keys exist, the global batch splits over its
    8 processes, reduce_dtype fp16 is a run of its own; and the budget comment's sums are right."""
    import re

    import yaml

    from conftest import REPO
    from lab.core.config import resolve_run, validate_study
    text = (REPO / "configs" / "lm-fsdp.yaml").read_text()
    s = yaml.safe_load(text)
    s["data"] = {"name": "pydoc", "context": 1024, "vocab_size": 50257}
    s = validate_study(s)
    run = resolve_run(s, "lm", "fp16-dynamic-reduce16", 0)
    assert run.parallel == "fsdp" and run.mode.reduce_dtype == "fp16" and s["processes_per_run"] == 8
    tokens = s["train"]["max_steps"] * s["train"]["batch_size"] * 1024
    assert f"{tokens:,}" in text
    fp16_rate, fp32_rate = 106_667 * 8 * 0.85, 15_092 * 8 * 0.85
    assert f"{round(tokens / fp16_rate)} s a run" in text and f"{round(tokens / fp32_rate):,} s a run" in text
    n_fp32, n_low = 2, 8
    total = (n_fp32 * tokens / fp32_rate + n_low * tokens / fp16_rate) / 3600
    assert re.search(rf"= {total:.1f} node-h", text)

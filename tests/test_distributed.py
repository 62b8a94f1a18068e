"""One run on two processes (gloo on CPU): `torchrun --nproc-per-node 2 -m lab train` (lab/run/distributed.py)."""
import copy
import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from conftest import REPO, forked_ranks, fresh_thread_pool, tiny_study

STEPS = 8


def study_file(tmp_path) -> str:
    s = tiny_study()
    # the LM: LayerNorm (no per-rank BatchNorm statistics) and no timm to import in each process
    s["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 16, "vocab_size": 256,
                                                         "val_fraction": 0.1}}}
    s["modes"] = {"fp32": {"precision": "fp32"},
                  "dyn": {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 1024,
                                                          "growth_interval": 3}}}
    s["train"].update(max_steps=STEPS, census_every=2, log_every=2, batch_size=32)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(s))
    return str(path)


def lab_train(tmp_path, out, mode, nproc=1, *sets, torchrun=True):
    """`[torchrun --nproc-per-node nproc] python -m lab train ...`; torchrun=False: the ranks forked from this
    process (conftest.forked_ranks), for the tests that are not about the launcher."""
    if not torchrun:
        argv = ["train", "--model", "lm", "--mode", mode, "--seed", "0", "--out", str(out),
                "--config", study_file(tmp_path), *(a for s in sets for a in ("--set", s))]
        return forked_ranks(argv, nproc, {"TMPDIR": str(tmp_path)})
    cmd = [sys.executable, "-m", "lab", "train", "--model", "lm", "--mode", mode, "--seed", "0", "--out", str(out),
           "--config", study_file(tmp_path), *(a for s in sets for a in ("--set", s))]
    if nproc > 1:
        cmd[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return res


def test_two_processes_train_like_one_with_the_same_global_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for out, n in ((one, 1), (two, 2)):
        res = lab_train(tmp_path, out, "fp32", n, torchrun=False)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = (pd.read_csv(d / "steps.csv") for d in (one, two))
    assert list(a["step"]) == list(b["step"]) == list(range(STEPS))
    # the loss logged is the global batch's; gradients equal up to the order of FP32 reductions
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-5)
    pd.testing.assert_series_equal(a["grad_norm"], b["grad_norm"], rtol=1e-5)
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert mb["world_size"] == 2 and mb["batch_per_rank"] == 16 and mb["ranks_agree"]
    assert mb["numerics_view"] == "rank 0 of 2" and mb["tokens_per_step"] == ma["tokens_per_step"] == 32 * 16
    assert mb["final_val_loss"] == pytest.approx(ma["final_val_loss"], rel=1e-4)
    assert mb["init_params_sha"] == ma["init_params_sha"]
    # rank 0 alone wrote the run directory; rank 1's copies went to a temporary folder, removed at the end
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert not list(tmp_path.glob("lab-rank*")), "rank 1's temporary folder was left behind"
    assert res.stdout.count("status ok") == 1  # one report, rank 0's


def test_an_inf_on_rank_1_only_makes_both_ranks_skip_and_back_off(tmp_path):
    fault = "train.faults=[{step: 3, into: activation_grad, module: blocks.1.attn.proj, value: inf, rank: 1}]"
    res = lab_train(tmp_path, tmp_path / "run", "dyn", 2, fault, torchrun=False)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    assert list(steps.loc[steps["found_inf"] == 1, "step"]) == [3]
    assert list(steps.loc[steps["skipped"] == 1, "step"]) == [3]
    # dynamic, growth every 3 clean steps: 1024 x2 at step 3 (after 0-2), halved by the skip, x2 after 4-6
    assert list(steps["scale"]) == [1024.0] * 3 + [2048.0] + [1024.0] * 3 + [2048.0]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["ranks_agree"] and len(set(m["rank_scale_digests"])) == 1 and len(set(m["rank_param_digests"])) == 1
    assert m["planted_steps"] == [3] and m["faults_planted"][0]["rank"] == 1
    # rank 0's replay of the step does not see rank 1's inf: the step is left unattributed, as documented
    assert m["first_overflow_step"] == 3 and m["first_nonfinite_layer"] == ""


def test_a_global_batch_that_does_not_split_evenly_is_refused(tmp_path):
    res = lab_train(tmp_path, tmp_path / "run", "fp32", 2, "train.batch_size=33")
    # the first rank to stop exits with the status of a refused config (2), not any crash; torchrun then stops
    # the other (SIGTERM, -15) unless it refused too, and itself exits 1
    assert res.returncode == 1
    root = res.stderr[res.stderr.index("Root Cause"):]
    assert re.search(r"exitcode\s*: 2 ", root), res.stderr[-3000:]
    codes = dict(re.findall(r"rank\s*: (\d) .*\n\s*exitcode\s*: (-?\d+)", res.stderr))
    assert sorted(codes) == ["0", "1"] and set(codes.values()) <= {"2", "-15"}, codes
    assert "train.batch_size: expected a multiple of the 2 processes" in res.stderr
    assert not (tmp_path / "run").exists()


def _scaler_worker(rank, init_file, agree, out):
    fresh_thread_pool()  # before gloo's threads start
    from lab import scaling
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = scaling.create("dynamic", init_scale=256.0, growth_interval=2, device="cpu")
    if agree:
        scaler.agree_across_ranks()
    record = []
    for step in range(6):
        loss = (w * w).sum()
        scaler.scale(loss).backward()
        if rank == 1 and step == 2:
            w.grad[0] = float("inf")  # a gradient no all-reduce carries: only this rank sees the inf
        scaler.step(opt)
        scaler.update()
        record.append((scaler.last_step_skipped, scaler.get_scale()))
        opt.zero_grad()
    out[rank] = record
    # without agreement no collective joins the ranks after the rendezvous: one could tear its group down while the
    # other still connects its side of gloo's mesh ("Connection closed by peer", seen once in a full suite)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("agree", [True, False])
def test_the_scaler_agrees_found_inf_for_gradients_that_are_not_all_reduced(tmp_path, agree):
    out = mp.Manager().dict()
    mp.start_processes(_scaler_worker, args=(str(tmp_path / "init"), agree, out), nprocs=2, start_method="fork")
    if agree:  # both ranks skip step 2 and keep the same scale at every step
        assert out[0] == out[1] and [s for s, _ in out[0]] == [False, False, True, False, False, False]
    else:  # the control: without agreement the ranks part ways (GradScaler's behaviour)
        assert out[0] != out[1]


def _record_worker(rank, init_file, tmp, out):
    fresh_thread_pool()  # before gloo's threads start
    import lab
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lab.scaling.create("dynamic", init_scale=256.0, device="cpu")
    g = torch.Generator().manual_seed(rank)
    with lab.record(model, scaler, out=f"{tmp}/rec{rank}", census_every=2, log_every=2) as rec:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4, generator=g)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            rec.step(loss)
            opt.zero_grad()
    out[rank] = {"steps": rec.step_index, "census_steps": rec.monitor.census_steps}
    dist.destroy_process_group()


def test_under_ddp_every_rank_records_and_rank_0_writes(tmp_path):
    """record.md: every rank records (its census hooks are its own) and only rank 0 writes a file. Each rank is
    given its own folder here, so a write by rank 1 would show."""
    out = mp.Manager().dict()
    mp.start_processes(_record_worker, args=(str(tmp_path / "init"), str(tmp_path), out), nprocs=2, start_method="fork")
    assert out[0] == out[1] == {"steps": 6, "census_steps": 3}
    assert json.loads((tmp_path / "rec0" / "metrics.json").read_text())["steps"] == 6
    assert not (tmp_path / "rec1").exists()


def test_a_two_process_run_stopped_by_sigterm_resumes_exactly(tmp_path):
    """torchrun passes SIGTERM to both ranks; they agree to save at the same step (rank 0 writes the checkpoint
    with both ranks' generators), and the same command resumes: the same steps.csv and census.csv."""
    import signal
    import time
    sets = ("train.max_steps=30", "train.epochs=3", "train.checkpoint_every=10")
    whole = lab_train(tmp_path, tmp_path / "whole", "dyn", 2, *sets, torchrun=False)
    assert whole.returncode == 0, whole.stderr[-3000:]

    cut = tmp_path / "cut"
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lab", "train",
           "--model", "lm", "--mode", "dyn", "--seed", "0", "--out", str(cut), "--config", study_file(tmp_path),
           *(a for s in sets for a in ("--set", s))]
    run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not list(cut.glob("checkpoint/*.pt")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=120)
    assert not (cut / "metrics.json").exists(), "the run ended before the signal"
    assert "checkpoint written to" in out and out.count("checkpoint written to") == 1, out[-2000:]
    saved = sorted(cut.glob("checkpoint/*.pt"))
    # the data shards and generators depend on the number of processes: one process may not take it over
    alone = lab_train(tmp_path, cut, "dyn", 1, *sets, torchrun=False)
    assert alone.returncode == 2 and "written by a run of 2 process(es), not 1" in alone.stderr, alone.stderr[-2000:]
    assert sorted(cut.glob("checkpoint/*.pt")) == saved and not (cut / "metrics.json").exists()
    resumed = lab_train(tmp_path, cut, "dyn", 2, *sets)
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]
    for name in ("steps.csv", "census.csv"):
        assert (cut / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_the_workflow_runs_a_study_with_two_processes_per_run(repo_copy, tmp_path):
    """processes_per_run: 2 -> the train rule launches torchrun (and would ask for 2 GPUs on CUDA)."""
    from test_workflow import snakemake
    study = yaml.safe_load(open(study_file(tmp_path)))
    study["processes_per_run"] = 2
    (repo_copy / "configs" / "ddp.yaml").write_text(yaml.safe_dump(study))
    study["seeds"], study["seeds_per_job"] = [0, 1], 2  # a torchrun job trains one run: one job per seed
    (repo_copy / "configs" / "ddp.yaml").write_text(yaml.safe_dump(study))
    target = "results/runs/lm/fp32/seeds0.json"
    res = snakemake(repo_copy, target, "--cores", "2", "--configfile", "configs/ddp.yaml")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (repo_copy / "results" / "runs" / "lm" / "fp32" / "seed1").exists()
    m = json.loads((repo_copy / "results" / "runs" / "lm" / "fp32" / "seed0" / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["ranks_agree"] and m["threads"] == 1


def test_rank_agreement_counts_parameters_and_scales_not_batchnorm_statistics():
    """Two ranks in lockstep hold the same parameters but their own BatchNorm running statistics (no --sync-bn):
    they agree, and metrics say the buffers differ; a parameter or a scale that differs makes them disagree."""
    from lab.run.train import rank_agreement, rank_digests
    torch.manual_seed(0)
    rank0 = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    rank1 = copy.deepcopy(rank0)
    for m, x in ((rank0, torch.randn(8, 1, 6, 6)), (rank1, torch.randn(8, 1, 6, 6))):
        m.train()(x)  # each rank's own batch updates its own running statistics
    scales = [65536.0, 32768.0]
    agree = rank_agreement([rank_digests(rank0, scales), rank_digests(rank1, scales)])
    assert agree["ranks_agree"] and agree["ranks_differ_in"] == ["buffers"]
    assert len(set(agree["rank_param_digests"])) == 1 and len(set(agree["rank_buffer_digests"])) == 2
    with torch.no_grad():
        rank1[0].weight[0, 0, 0, 0] += 1.0
    split = rank_agreement([rank_digests(rank0, scales), rank_digests(rank1, scales[:1] + [16384.0])])
    assert not split["ranks_agree"] and split["ranks_differ_in"] == ["parameters", "buffers", "scale trajectory"]

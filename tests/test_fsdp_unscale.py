"""FSDP + AMP: who decides an overflow step, and in which order unscale_ runs (configs/fsdp-unscale.yaml,
docs/distributed.md). Two gloo processes, an inf planted in rank 1's shard only:

* the lab's agreed decision skips the step on both ranks, as torch.amp.GradScaler does over FSDP2's DTensor gradients
  (DTensor agrees found_inf itself); `decide_alone` (the study's per-rank control) skips it on rank 1 only and the
  ranks' scales part, as torch.amp.GradScaler does over FSDP1's flat shards: the reference, decision for decision;
* unscaling before the reduce-scatter (each rank's own gradient times 1/S before the sum, a custom reduce-scatter)
  gives FSDP2's reduced gradient unscaled after it bit for bit when S is a power of two and the sum is FP32; with an
  FP16 sum the early unscale flushes values the late one keeps;
* `lab train` under torchrun, a param_grad fault in rank 1's shard: metrics.json's per-rank counts."""
import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import fresh_thread_pool

STEPS, PLANT_STEP = 8, 3
KINDS = ("lab-agreed", "lab-alone", "GradScaler-fsdp2", "GradScaler-fsdp1")


def _model(kind: str, reduce_dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if kind == "GradScaler-fsdp1":  # one flat parameter, its rank's half a plain tensor
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP1's deprecation notice
            return FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=MixedPrecision(
                param_dtype=torch.float16, reduce_dtype=torch.float32))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _train(rank: int, kind: str) -> dict:
    """STEPS steps of one kind; per step this rank's scale, whether its shard moved, and (lab) its own check."""
    from lab import scaling
    from lab.core.shards import local_shard
    model = _model(kind)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    if kind.startswith("GradScaler"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    else:
        scaler = scaling.create("dynamic", device="cpu", init_scale=2.0 ** 10, growth_interval=3)
        if kind == "lab-alone":
            scaler.decide_alone()
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    steps = []
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        scaler.scale(torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
        if step == PLANT_STEP and rank == 1:  # one value of rank 1's shard: rank 0's shard stays finite
            local_shard(params[0].grad).view(-1)[0] = float("inf")
        before = [local_shard(p).detach().clone() for p in params]
        scale = float(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(local_shard(p), b) for p, b in zip(params, before))
        steps.append({"scale": scale, "skipped": skipped, "own": getattr(scaler, "last_found_inf_own", None)})
        opt.zero_grad()
    whole = [p.full_tensor().detach().clone() for p in params] if kind != "GradScaler-fsdp1" else None
    return {"steps": steps, "params": whole}


class _Unscaled:
    """A reduce-scatter that multiplies each rank's own (unsharded) gradient by 1/S before the sum: unscale_ before
    sharding, as the source orders it. Counts its calls."""

    def __new__(cls, inv: float):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        class Comm(DefaultReduceScatter):
            calls = 0

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                Comm.calls += 1
                input_tensor.mul_(inv)
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
        return Comm()


def _order(rank: int, reduce_dtype: torch.dtype, out) -> None:
    """One backward at scale S; this rank's shard unscaled after the reduce-scatter (FSDP2's order) and before it."""
    from lab.core.shards import local_shard
    S = 2.0 ** 16
    shards = {}
    for order in ("after", "before"):
        model = _model("fsdp2", reduce_dtype)
        comm = None
        if order == "before":
            comm = _Unscaled(1 / S)
            for m in model.modules():
                if hasattr(m, "set_custom_reduce_scatter"):
                    m.set_custom_reduce_scatter(comm)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        # 2^-12: gradients whose unscaled values lie near FP16's bottom, where the order can matter
        (torch.nn.functional.cross_entropy(model(x).float(), y) * 2.0 ** -12 * S).backward()
        grads = [local_shard(p.grad).detach().clone() for p in model.parameters()]
        shards[order] = [t / S for t in grads] if order == "after" else grads
        shards["calls"] = type(comm).calls if comm is not None else shards.get("calls")
        shards["scaled"] = grads if order == "after" else shards["scaled"]
    out[("order", str(reduce_dtype), rank)] = shards


def _worker(rank, init_file, out):
    fresh_thread_pool()  # before gloo's threads start
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for kind in KINDS:
        out[(kind, rank)] = _train(rank, kind)
    for reduce_dtype in (torch.float32, torch.float16):
        _order(rank, reduce_dtype, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(str(tmp_path_factory.mktemp("unscale") / "init"), out), nprocs=2,
                       start_method="fork")
    return dict(out)


def _decisions(run: dict) -> list[tuple[float, bool]]:
    return [(s["scale"], s["skipped"]) for s in run["steps"]]


def test_agreed_skips_on_both_ranks_alone_on_rank_1_only(ranks):
    planted = [s == PLANT_STEP for s in range(STEPS)]
    agreed, alone = [ranks[("lab-agreed", r)] for r in (0, 1)], [ranks[("lab-alone", r)] for r in (0, 1)]
    for run in agreed:
        assert [s["skipped"] for s in run["steps"]] == planted
    assert _decisions(agreed[0]) == _decisions(agreed[1])
    # each rank's own check saw the inf on rank 1 only, in both: the agreement is what made rank 0 skip
    for runs in (agreed, alone):
        assert [s["own"] for s in runs[1]["steps"]] == planted and not any(s["own"] for s in runs[0]["steps"])
    assert [s["skipped"] for s in alone[1]["steps"]] == planted and not any(s["skipped"] for s in alone[0]["steps"])
    scales = [[s["scale"] for s in run["steps"]] for run in alone]
    assert scales[0][:PLANT_STEP + 1] == scales[1][:PLANT_STEP + 1] and scales[0][PLANT_STEP + 1] == \
        2 * scales[1][PLANT_STEP + 1]  # rank 1 backed off, rank 0 did not: every later backward at unequal scales
    # FSDP2 keeps one copy of each value: the gathered parameters are the same on both ranks even so
    assert all(torch.equal(a, b) for a, b in zip(alone[0]["params"], alone[1]["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(alone[0]["params"], agreed[0]["params"]))


def test_the_references_gradscaler_over_fsdp2_agrees_over_fsdp1_each_rank_alone(ranks):
    for rank in (0, 1):
        assert _decisions(ranks[("lab-agreed", rank)]) == _decisions(ranks[("GradScaler-fsdp2", rank)])
        assert _decisions(ranks[("lab-alone", rank)]) == _decisions(ranks[("GradScaler-fsdp1", rank)])
        for a, b in zip(ranks[("lab-agreed", rank)]["params"], ranks[("GradScaler-fsdp2", rank)]["params"]):
            assert torch.equal(a, b)


def test_unscaling_before_the_reduce_scatter_changes_no_bit_in_fp32_and_flushes_in_fp16(ranks):
    for rank in (0, 1):
        fp32 = ranks[("order", str(torch.float32), rank)]
        assert fp32["calls"] > 0  # the custom reduce-scatter ran: the "before" shards were unscaled in it
        assert not all(torch.equal(a, b) for a, b in zip(fp32["before"], fp32["scaled"]))
        assert all(torch.equal(a, b) for a, b in zip(fp32["before"], fp32["after"]))  # 1/S = 2^-16: exact
        fp16 = ranks[("order", str(torch.float16), rank)]
        flushed = sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(fp16["after"], fp16["before"]))
        kept = sum(int(((a == 0) & (b != 0)).sum()) for a, b in zip(fp16["after"], fp16["before"]))
        assert flushed > 0 and kept == 0  # the FP16 sum of unscaled values loses what the scaled sum kept


def test_rank_decisions_counts_each_kind_of_disagreement():
    from lab.run.train import rank_decisions
    rank0 = ([8.0, 8.0, 8.0, 8.0], [0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4], [0, 0, 0, 0])
    rank1 = ([8.0, 8.0, 4.0, 4.0], [0, 1, 0, 0], [0.1, 0.2, 0.2, 0.3], [0, 1, 0, 0])
    assert rank_decisions([rank0, rank1]) == {
        "rank_skipped_steps": [0, 1], "rank_own_overflow_disagreements": 1, "rank_skip_disagreements": 1,
        "rank_scale_disagreements": 2, "rank_lr_disagreements": 2}
    assert rank_decisions([rank0, rank0]) == {
        "rank_skipped_steps": [0, 0], "rank_own_overflow_disagreements": 0, "rank_skip_disagreements": 0,
        "rank_scale_disagreements": 0, "rank_lr_disagreements": 0}


def test_lab_train_per_rank_disagrees_on_an_inf_in_rank_1s_shard_and_agreed_does_not(tmp_path):
    """torchrun, two ranks of `lab train` (the LM sharded per block, FP16 weights): a param_grad fault in rank 1's
    shard at step 3. Agreed: both skip it, the ranks' own checks differed once. Per-rank: rank 1 alone skips and
    every later step runs at unequal scales; the gathered parameters are the same on both ranks all the same."""
    from conftest import tiny_study
    from test_fsdp import _lab_train
    s = tiny_study()
    s.update(processes_per_run=2, parallel="fsdp")
    s["models"] = {"lm": {"preset": "gpt-tiny", "data": {"name": "pydoc", "context": 16, "vocab_size": 256,
                                                         "val_fraction": 0.1}}}
    dyn = {"precision": "fp16", "scaler": {"policy": "dynamic", "init_scale": 1024, "growth_interval": 100}}
    s["modes"] = {"agreed": dyn, "per-rank": {**dyn, "overflow_decision": "per-rank"}}
    s["train"].update(max_steps=6, epochs=1, census_every=0, log_every=2, batch_size=32,
                      faults=[{"step": 3, "into": "param_grad", "param": "blocks.0.mlp.fc.weight", "value": "inf",
                               "rank": 1}])
    got = {}
    for mode in ("agreed", "per-rank"):
        run = _lab_train(tmp_path, s, tmp_path / mode, mode)
        assert run.returncode == 0, run.stderr[-3000:]
        got[mode] = json.loads((tmp_path / mode / "metrics.json").read_text())
    agreed, alone = got["agreed"], got["per-rank"]
    assert agreed["overflow_decision"] == "agreed" and alone["overflow_decision"] == "per-rank"
    assert agreed["planted_steps"] == alone["planted_steps"] == [3]
    assert agreed["rank_skipped_steps"] == [1, 1] and agreed["rank_own_overflow_disagreements"] == 1
    assert agreed["rank_skip_disagreements"] == agreed["rank_scale_disagreements"] == 0 and agreed["ranks_agree"]
    assert alone["rank_skipped_steps"] == [0, 1] and alone["rank_skip_disagreements"] == 1
    assert alone["rank_scale_disagreements"] == alone["rank_lr_disagreements"] == 2  # steps 4 and 5
    assert alone["ranks_differ_in"] == ["scale trajectory"]  # one copy of each parameter: gathered alike

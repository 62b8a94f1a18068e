"""Every shipped config sized on the CPU (issue 40): each run's training step and evaluation, traced on fake tensors
by lab/run/sizing.py, fit the GPU the config names (or a CPU run's budget). The evaluation batch of before (256
windows of GPT-2 small) is caught."""
from __future__ import annotations

import pytest

from conftest import REPO
from lab.run import parts, sizing

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("claims"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_run_of_a_shipped_config_fits_its_device(name):
    study, shapes = sizing.load_for_sizing(REPO / "configs" / name)
    device, budget_gib = sizing.target(study)
    sizes = sizing.size_study(study, shapes)
    assert {s.family for s in sizes} == set(study["models"])
    too_big = [f"{s.family}/{s.mode}: training {s.train_gib:.1f} GiB, evaluation {s.eval_gib:.1f} GiB "
               f"(batch {s.eval_batch})" for s in sizes if s.peak_gib > budget_gib]
    assert not too_big, f"{name} on {device} ({budget_gib:.1f} GiB usable): {too_big}"


def test_the_evaluation_batch_of_before_does_not_fit(monkeypatch):
    """train.py's validation batch was max(256, batch_size): 256 windows x 1024 tokens x 50,257 logits
    (finetune-gpu.yaml's GPT-2 small on a T4 has the same evaluation, in a fifth of the memory)."""
    study, shapes = sizing.load_for_sizing(REPO / "configs" / "lm-fsdp.yaml")
    device, budget_gib = sizing.target(study)
    monkeypatch.setattr(sizing, "eval_batch_size", lambda task, classes, size, batch: max(256, batch))
    lm = [s for s in sizing.size_study(study, shapes) if s.eval_batch == 256]
    assert lm and all(s.eval_gib > budget_gib for s in lm)


def test_the_trace_holds_at_least_the_logits_it_counts():
    """The evaluation's traced peak includes the batch's logits as eval_batch_size counts them, and the training
    step at least the FP32 parameters, their gradients and AdamW's two moments."""
    study, shapes = sizing.load_for_sizing(REPO / "configs" / "lm-fsdp.yaml")
    [fp32] = [s for s in sizing.size_study(study, shapes) if s.mode == "fp32"]
    task, vocab, _, context = shapes["lm"]
    assert fp32.eval_gib * 2**30 >= fp32.eval_batch * context * vocab * parts.EVAL_LOGIT_BYTES
    params = 124e6  # GPT-2 small's shape
    assert fp32.train_gib * 2**30 >= 4 * 4 * params * 0.99


def test_live_bytes_equals_torchs_memtracker():
    """sizing's own counter against torch's MemTracker on one training step of a small GPT, on fake tensors."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from lab.models.gpt import GPTConfig
    with FakeTensorMode():
        model = GPTConfig(vocab_size=5000, context=128, n_layer=2, n_head=4, d_model=128).build()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, 5000, (8, 128))

        def step():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            F.cross_entropy(out.reshape(-1, 5000).float(), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        ours = sizing._traced_peak_gib(model, opt, step)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        theirs = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) / 2**30
    assert ours == pytest.approx(theirs, rel=1e-9) and ours > 0

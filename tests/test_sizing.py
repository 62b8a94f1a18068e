"""Every shipped config sized on the CPU: each run's training step and evaluation, traced on fake tensors
by lab/run/sizing.py, fit the GPU the config names (or a CPU run's budget). The evaluation batch of before (256
windows of GPT-2 small) is caught. The traces run in a process of their own: they start autograd's device
threads, after which the suite's forked runs could not run a backward (lab/run/sizing.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from lab.run import evaluation

# the RL study (study: rl) trains a 2 x 64 GPT on the CPU by its own runner (lab/rl/grpo_run.py), the alert study
# (study: alerts) trains nothing: nothing to size
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                 if not p.name.startswith("claims") and "study: rl" not in p.read_text()
                 and "study: alerts" not in p.read_text())

SIZE_ALL = """
import json, sys
from lab.run import sizing
configs = sys.argv[1:]
out = {"now": sizing.report(configs), "before": sizing.report(["configs/lm-fsdp.yaml"], eval_batch=256)}
print(json.dumps(out))
"""

COMPARE_WITH_MEMTRACKER = """
import json
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from lab.models.gpt import GPTConfig
from lab.run import sizing
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
print(json.dumps([ours, theirs]))
"""


def _isolated(code: str, *args) -> object:
    res = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def sized():
    return _isolated(SIZE_ALL, *(f"configs/{name}" for name in CONFIGS))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_run_of_a_shipped_config_fits_its_device(name, sized):
    config = sized["now"][f"configs/{name}"]
    device, budget_gib = config["target"]
    assert {s["family"] for s in config["sizes"]} == set(config["families"])
    too_big = [f"{s['family']}/{s['mode']}: training {s['train_gib']:.1f} GiB, evaluation {s['eval_gib']:.1f} GiB "
               f"(batch {s['eval_batch']})" for s in config["sizes"]
               if max(s["train_gib"], s["eval_gib"]) > budget_gib]
    assert not too_big, f"{name} on {device} ({budget_gib:.1f} GiB usable): {too_big}"


def test_the_evaluation_batch_of_before_does_not_fit(sized):
    """train.py's validation batch was max(256, batch_size): 256 windows x 1024 tokens x 50,257 logits
    (finetune-gpu.yaml's GPT-2 small on a T4 has the same evaluation, in a fifth of the memory)."""
    before = sized["before"]["configs/lm-fsdp.yaml"]
    _, budget_gib = before["target"]
    assert before["sizes"] and all(s["eval_batch"] == 256 and s["eval_gib"] > budget_gib for s in before["sizes"])


def test_the_trace_holds_at_least_the_logits_it_counts(sized):
    """The evaluation's traced peak includes the batch's logits as eval_batch_size counts them, and the training
    step at least the FP32 parameters, their gradients and AdamW's two moments."""
    config = sized["now"]["configs/lm-fsdp.yaml"]
    [fp32] = [s for s in config["sizes"] if s["mode"] == "fp32"]
    task, vocab, _, context = config["shapes"]["lm"]
    assert fp32["eval_gib"] * 2**30 >= fp32["eval_batch"] * context * vocab * evaluation.EVAL_LOGIT_BYTES
    params = 124e6  # GPT-2 small's shape
    assert fp32["train_gib"] * 2**30 >= 4 * 4 * params * 0.99


def test_live_bytes_equals_torchs_memtracker():
    """sizing's own counter against torch's MemTracker on one training step of a small GPT, on fake tensors."""
    ours, theirs = _isolated(COMPARE_WITH_MEMTRACKER)
    assert ours == pytest.approx(theirs, rel=1e-9) and ours > 0

"""`lab.record`: a training loop written by hand, recorded into a lab run directory that `lab diagnose`, `lab
inspect` and `lab replay` read unchanged (lab/run/record.py, lab/diagnose/inspect.py)."""
import csv
import json

import pytest
import torch

import lab
import lab.scaling
from lab.cli import main
from lab.diagnose import diagnose
from lab.diagnose.inspect import follow, format_inspect, inspect_run
from lab.run.record import RecordError


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def train(model, opt, scaler, rec, data, fp16=True, between=None):
    loss_fn = torch.nn.CrossEntropyLoss()
    truth = []  # per step: did the parameters stay as they were (a skipped step)?
    for i, (x, y) in enumerate(data):
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if rec is not None:  # None: the same loop unrecorded
            rec.step(loss)
        truth.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        opt.zero_grad(set_to_none=True)
        if between is not None:
            between(i)
    return truth


def read_steps(d):
    with open(d / "steps.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_gradscaler_loop_recorded_truthfully(tmp_path):
    """torch.amp.GradScaler from 2^40 skips its way down; the recording's skips are the steps whose parameters
    did not move, its scales are GradScaler's, and diagnose, inspect and replay read it."""
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=4)
    out = tmp_path / "rec"
    scales = []
    with lab.record(model, scaler, out=out, optimizer=opt, census_every=3, log_every=4) as rec:
        truth = train(model, opt, scaler, rec, batches(30), between=lambda i: scales.append(scaler.get_scale()))
    rows = read_steps(out)
    assert [r["skipped"] == "1" for r in rows] == truth and sum(truth) >= 5
    assert [float(r["scale"]) for r in rows[1:]] == scales[:-1]  # the scale each step used
    m = json.loads((out / "metrics.json").read_text())
    assert m["skipped_steps"] == sum(truth) and m["scaler"] == "torch.amp.GradScaler" and m["status"] == "ok"
    assert m["census_steps"] == 10 and (out / "census.csv").is_file() and (out / "provenance.json").is_file()
    assert all(r["first_nonfinite_source"] == "param_grad" for r in rows if r["found_inf"] == "1")
    d = diagnose(out)
    assert d.skipped_steps == sum(truth) and d.initial_overflow_streak >= 5
    s = inspect_run(out)
    assert s["finished"] and s["skipped"] == sum(truth) and s["steps"] == 30
    assert main(["replay", str(out), "--policy", "dynamic:init_scale=1099511627776.0,growth_interval=4"]) == 0


def test_lab_scaler_with_a_replay_names_the_activation_and_reset_scale_is_recorded(tmp_path):
    model, opt = make()
    scaler = lab.scaling.create("dynamic", device="cpu", init_scale=2.0**40)
    data = batches(12)
    current = {}

    def replay():  # the step's forward and scaled backward again, on the same batch
        x, y = current["batch"]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()

    class Tracking(list):
        def __iter__(self):
            for b in list.__iter__(self):
                current["batch"] = b
                yield b

    out = tmp_path / "rec"
    with lab.record(model, scaler, out=out, optimizer=opt, replay=replay, census_every=5) as rec:
        train(model, opt, scaler, rec, Tracking(data),
              between=lambda i: scaler.reset_scale(256.0) if i == 3 else None)
    rows = read_steps(out)
    sources = {r["first_nonfinite_source"] for r in rows if r["found_inf"] == "1"}
    assert sources == {"activation_grad"}  # the replay sees the activation gradient go inf first
    m = json.loads((out / "metrics.json").read_text())
    assert m["scale_resets"] == [{"update": 4, "from": 2.0**36, "to": 256.0}]
    assert float(rows[4]["scale"]) == 256.0 and m["scaler"] == "dynamic"
    assert "scale set by hand" in format_inspect(inspect_run(out))


def test_fp32_loop_census_and_the_partial_steps_while_running(tmp_path):
    model, opt = make()
    out = tmp_path / "rec"
    rec = lab.record(model, None, out=out, census_every=2, log_every=3)
    seen = []
    train(model, opt, None, rec, batches(7), fp16=False, between=lambda i: seen.append(inspect_run(out)["steps"]))
    assert seen == [0, 0, 3, 3, 3, 6, 6]  # what has streamed to steps.csv.partial so far
    assert not inspect_run(out)["finished"]
    lines = []
    follow(out, interval=0.01, printer=lines.append, max_wait=0.05)
    assert "running" in lines[-1]
    rec.close(final_val_loss=1.5)
    m = json.loads((out / "metrics.json").read_text())
    assert m["precision"] == "fp32" and m["steps"] == 7 and m["final_val_loss"] == 1.5 and m["census_steps"] == 4
    census = list(csv.DictReader(open(out / "census.csv")))
    assert {float(r["at_scale"]) for r in census} == {1.0, 128.0, 1024.0, 65536.0}  # FP32: the counterfactual
    with pytest.raises(RecordError, match="finished run"):
        lab.record(model, None, out=out)


def test_follow_says_a_line_still_being_written_once(tmp_path, caplog):
    """`lab inspect --follow` polls a live run: its steps file ending inside a line is said once, not per poll."""
    import logging
    model, opt = make()
    out = tmp_path / "rec"
    rec = lab.record(model, None, out=out, log_every=1)
    train(model, opt, None, rec, batches(3), fp16=False)
    partial = out / "steps.csv.partial"
    partial.write_text(partial.read_text() + "3,0.5")  # the next row, half written
    with caplog.at_level(logging.WARNING, logger="lab.core.runfiles"):
        follow(out, interval=0, printer=lambda line: None, max_wait=0.05)
    said = [r.getMessage() for r in caplog.records if "incomplete last line" in r.getMessage()]
    assert len(said) == 1 and "line 5" in said[0], said
    rec.close()


def test_a_crash_inside_the_block_is_recorded_as_failed(tmp_path):
    model, opt = make()
    out = tmp_path / "rec"
    with pytest.raises(RuntimeError, match="boom"):
        with lab.record(model, None, out=out) as rec:
            train(model, opt, None, rec, batches(2), fp16=False)
            raise RuntimeError("boom")
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "failed" and "boom" in m["error"] and m["steps"] == 2
    assert len(read_steps(out)) == 2


def test_inspect_cli(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    model, opt = make()
    with lab.record(model, None, out=tmp_path / "r") as rec:
        train(model, opt, None, rec, batches(3), fp16=False)
    assert main(["inspect", str(tmp_path / "r"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3


def test_the_installed_package_records_and_diagnoses_from_another_folder(tmp_path):
    """`pip install .` (here into a target folder, dependencies already present): lab imports from there, not from
    the repository, and records, diagnoses and replays a loop run from an unrelated folder."""
    import subprocess
    import sys
    from conftest import REPO
    import shutil
    src = tmp_path / "clone"  # setuptools builds in the source tree (build/, *.egg-info): not in the repository
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "lab", src / "lab", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (site / "lab" / "core" / "schemas" / "config.schema.yaml").is_file()
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = ("import torch, lab, lab.scaling\n"
            "assert lab.__file__.startswith(%r), lab.__file__\n"
            "m = torch.nn.Linear(4, 2); opt = torch.optim.SGD(m.parameters(), 0.1)\n"
            "s = lab.scaling.create('amax-history', device='cpu')\n"
            "with lab.record(m, s, out='rec') as rec:\n"
            "    for _ in range(3):\n"
            "        with torch.autocast('cpu', dtype=torch.float16):\n"
            "            loss = m(torch.randn(8, 4)).float().pow(2).mean()\n"
            "        s.scale(loss).backward(); s.step(opt); s.update(); rec.step(loss); opt.zero_grad()\n"
            "from lab.cli import main\n"
            "assert [main(a) for a in (['diagnose', 'rec'], ['replay', 'rec'], ['inspect', 'rec'])] == [0, 0, 0]\n"
            % str(site))
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Diagnosis of rec" in res.stdout and "amax-history" in res.stdout


def test_a_transformers_gpt2_loop_recorded_under_the_cpu_contract(tmp_path, monkeypatch):
    """A Hugging Face GPT-2 (small config, random weights) in a plain loop, FP16 on the CPU under the lab's
    tensor-core contract, recorded with one added line: the contract computed its matmuls and attention (calls
    counted), and diagnose and inspect read the recording."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lab.numerics import contract
    calls = {}
    for func, handler in list(contract._HANDLERS.items()):
        def counted(dt, a, kw, _h=handler, _f=func):
            calls[_f] = calls.get(_f, 0) + 1
            return _h(dt, a, kw)
        monkeypatch.setitem(contract._HANDLERS, func, counted)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = lab.scaling.create("dynamic", device="cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(0)
    out = tmp_path / "gpt2"
    with lab.record(model, scaler, out=out, optimizer=opt, census_every=4, name="gpt2") as rec:
        for _ in range(8):
            x = torch.randint(0, 256, (8, 32), generator=g)
            with lab.autocast("cpu", torch.float16):
                loss = model(input_ids=x, labels=x).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
    # per step: 4 Conv1D (addmm) and one attention in each of the 2 blocks, the LM head (linear)
    by_name = {}
    for f, n in calls.items():
        by_name[f.__name__] = by_name.get(f.__name__, 0) + n
    assert by_name == {"addmm": 8 * 2 * 4, "scaled_dot_product_attention": 8 * 2, "linear": 8}
    rows = read_steps(out)
    assert len(rows) == 8 and sum(r["skipped"] == "1" for r in rows) == scaler.skipped_steps >= 1
    d = diagnose(out)
    assert d.model == "gpt2" and d.skipped_steps == scaler.skipped_steps
    assert inspect_run(out)["steps"] == 8


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


def _count_host_reads(monkeypatch):
    """Count every read of a tensor's value to the host (on a GPU each is a synchronisation)."""
    counts = {"n": 0}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            counts["n"] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def test_under_gradscaler_the_recorder_reads_the_host_once_per_step(tmp_path, monkeypatch):
    """torch's GradScaler keeps the step's outcome on the device: the recorder brings back its found-inf and its
    new scale in one read per step (record.md), plus one per log_every steps for the logged values; a scale
    changed behind its back (update(new_scale)) is still seen."""
    def run(recorded, data):
        model, opt = make()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
        rec = lab.record(model, scaler, out=tmp_path / f"rec{recorded}", census_every=0, log_every=5) \
            if recorded else None
        counts = _count_host_reads(monkeypatch)
        train(model, opt, scaler, rec, data)
        n = counts["n"]
        monkeypatch.undo()
        if rec is not None:
            rec.close()
        return n, scaler, rec

    data = batches(10)
    (with_rec, scaler, rec), (without, _, _) = run(True, data), run(False, data)
    assert with_rec - without == 10 + 2
    rows = read_steps(tmp_path / "recTrue")
    assert any(r["found_inf"] == "1" for r in rows)
    # the logged scales are the ones each step used: each step's, from GradScaler's own rule
    scales = [float(r["scale"]) for r in rows]
    for a, b, r in zip(scales, scales[1:], rows):
        assert b == (a / 2 if r["found_inf"] == "1" else b) and b in (a / 2, a, a * 2)


def test_a_scale_set_between_steps_is_seen_without_a_per_step_read(tmp_path):
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    rec = lab.record(model, scaler, out=tmp_path / "rec", census_every=0, log_every=1)
    data = batches(3)
    train(model, opt, scaler, rec, data[:1])
    scaler.update(new_scale=64.0)  # out of band, between steps
    train(model, opt, scaler, rec, data[1:2])
    rec.close()
    assert [float(r["scale"]) for r in read_steps(tmp_path / "rec")] == [1024.0, 64.0]


@pytest.mark.parametrize("policy", [None, "dynamic", "amax-history"])
def test_recording_reads_the_host_once_per_log_every_and_grad_amax_adds_no_read(tmp_path, monkeypatch, policy):
    """record.md: the per-step values (loss, norm, grad_amax) stay on the device and come back in one transfer
    every log_every steps. The same loop with and without the recorder: the recorder's reads are exactly one per
    log_every steps (census off: it has its own, documented in census.md)."""
    def run(recorded):
        model, opt = make()
        scaler = lab.scaling.create(policy, init_scale=2.0**10) if policy else None
        rec = lab.record(model, scaler, out=tmp_path / f"rec{recorded}", census_every=0, log_every=5) \
            if recorded else None
        data = batches(10)
        counts = _count_host_reads(monkeypatch)
        train(model, opt, scaler, rec, data, fp16=scaler is not None)
        n = counts["n"]
        monkeypatch.undo()
        if rec is not None:
            rec.close()
            assert len(read_steps(tmp_path / f"rec{recorded}")) == 10
        return n

    assert run(True) - run(False) == 2  # two flushes of five steps, nothing per step

"""A run file cut at any point of its last line, or with garbage in its middle.

Every file a run directory holds is read through lab/core/runfiles.py, the one reader. For a finished run (it has
metrics.json) a last line without its end is damage: `lab diagnose` and `lab inspect` exit 2 with one line naming
the file and the line, never a traceback (before the one reader, fp8_census.csv, read by a csv.DictReader of its own,
ended in a TypeError, and a cut that only shortened the last number read as a smaller number). For a live run (no
metrics.json yet, or the step stream steps.csv.partial) the incomplete last line is left out and said: the answer is
the one the file's whole lines give, and a warning names the file and line. Garbage in the middle of a file is damage,
live or not.

One small FP8 run (lab.record, a GPT of the lab's under fp8-delayed, a census every other step) is recorded per
module, plus an rl_steps.csv as an RL run writes it; each test cuts a copy at every offset of one file's last line.
The commands run in-process (lab.cli.main).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import lab
from lab import cli
from lab.core import files

V, T = 64, 16
#: file -> the commands that read it (argv after the run directory: the file is refused before the work starts)
READERS = {
    "steps.csv": ("diagnose", "inspect"),
    "metrics.json": ("diagnose", "inspect"),
    "config.yaml": ("diagnose",),
    "census.csv": ("diagnose",),
    "grad_hist.csv": ("diagnose",),
    "fp8_census.csv": ("diagnose", "inspect"),
    "rl_steps.csv": ("diagnose",),
    "fp8_amax.csv": ("histories",),  # read by the learned controllers' fit (lab.scaling.learning.histories)
}
CSV_FILES = [f for f in READERS if f.endswith(".csv")]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished FP8 run: steps, census, grad_hist, fp8_census, fp8_amax, fp8_operands.pt, config, metrics; plus
    rl_steps.csv written as lab/rl/grpo_run.py writes it."""
    from lab.fp8 import create_recipe
    from lab.fp8.linear import convert
    from lab.models.presets import create_model
    from lab.rl.grpo_run import STEP_FIELDS
    out = tmp_path_factory.mktemp("cut") / "run"
    torch.manual_seed(0)
    model = create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)
    convert(model, create_recipe("fp8-delayed"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    with lab.record(model, None, out=out, optimizer=opt, precision="bf16", census_every=2, log_every=2) as rec:
        for _ in range(4):
            x = torch.randint(0, V, (4, T + 1), generator=g)
            with lab.autocast("cpu", torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x[:, :-1]).float().reshape(-1, V), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
    rows = [{f: 0.0 for f in STEP_FIELDS} | {"step": s, "reward": 0.25 * s, "ess": 0.97, "abs_mean": 1e-3 * (s + 1)}
            for s in range(4)]
    files.atomic_write_csv(out / "rl_steps.csv", rows, STEP_FIELDS)
    assert {p.name for p in out.iterdir()} >= set(READERS) | {"fp8_operands.pt"}
    return out


def read(name: str, run_dir: Path, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of reader ``name`` on the run: a command, or the fp8_amax.csv histories
    (printed, a RunFileError refused as the command line refuses it)."""
    if name == "histories":
        from lab.core.runfiles import RunFileError
        from lab.scaling.learning.histories import read as histories
        try:
            print([(h.tensor, h.amax.tolist()) for h in histories([run_dir], "fp8")])
            code = 0
        except RunFileError as e:
            code = cli.refuse(e)
    else:
        code = cli.main([name, str(run_dir)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def last_line_cuts(text: str, whole_ok: bool):
    """(offset, the line the file then ends in) for every offset inside the last line: the file ends after at
    least one of its characters, up to all of them without the end of line. ``whole_ok``, a JSON text (which may
    end without one: that offset is whole): the last two lines (the last is a lone brace), the cut right before
    them included."""
    body = text.rstrip("\n")
    start = body.rfind("\n") + 1
    if whole_ok:
        start = body.rfind("\n", 0, start - 1) + 1
    end = len(text) - 1  # the last line's end of line
    for k in range(start if whole_ok else start + 1, end if whole_ok else end + 1):
        yield k, text.count("\n", 0, k) + 1


def refused(code: int, err: str, path: Path, line: int | None) -> None:
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], err
    assert "Traceback" not in err
    if line is not None:
        assert f"{path}, line {line}:" in lines[0], err


@pytest.mark.parametrize("filename", list(READERS))
def test_a_finished_runs_cut_file_is_refused_at_every_offset(filename, run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / filename
    text = path.read_text()
    is_json = filename.endswith(".json")
    for name in READERS[filename]:
        code, _, err = read(name, copy, capsys)
        assert code == 0, err  # the whole file is read: a refusal below is the cut's doing
    cuts = list(last_line_cuts(text, whole_ok=is_json))
    assert len(cuts) >= 2
    for k, line in cuts:
        path.write_text(text[:k])
        for name in READERS[filename]:
            code, out, err = read(name, copy, capsys)
            # JSON names where it stopped parsing, or that the file is empty (cut right before its only line)
            refused(code, err, path, None if is_json else line)
            assert not out, (k, name, out)


@pytest.mark.parametrize("filename", CSV_FILES)
def test_garbage_in_the_middle_is_refused_naming_the_line(filename, run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / filename
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) >= 4
    path.write_text("".join(lines[:2] + ["garbage\n"] + lines[3:]))
    for name in READERS[filename]:
        refused(*read(name, copy, capsys)[::2], path, 3)
    # live or not: a live run's damage before its last line is damage too
    (copy / "metrics.json").unlink()
    if filename == "steps.csv":
        path = path.rename(copy / "steps.csv.partial")
    if "inspect" in READERS[filename]:
        refused(*read("inspect", copy, capsys)[::2], path, 3)


def whole_lines_only(path: Path, text: str) -> None:
    """The file as it was before its last line was begun: what a live run's cut file must read as."""
    path.write_text(text[:text.rstrip("\n").rfind("\n") + 1])


def live_cuts(run: Path, tmp_path: Path, filename: str, stream: bool, names, capsys, caplog) -> None:
    """Every cut of ``filename``'s last line in a live copy (no metrics.json; ``stream``: the steps as
    steps.csv.partial, a crashed run's, metrics.json kept) reads as the file without that line, and is said."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    if not stream:
        (copy / "metrics.json").unlink()
    (copy / "steps.csv").rename(copy / "steps.csv.partial")
    path = copy / ("steps.csv.partial" if filename == "steps.csv" else filename)
    text = path.read_text()
    whole_lines_only(path, text)
    expected = {name: read(name, copy, capsys) for name in names}
    assert all(code == 0 for code, _, _ in expected.values()), expected
    for k, line in last_line_cuts(text, whole_ok=False):
        path.write_text(text[:k])
        for name in names:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="lab.core.runfiles"):
                code, out, err = read(name, copy, capsys)
            assert (code, out) == expected[name][:2], (k, name, err)
            assert "Traceback" not in err and "error" not in err
            said = [r.getMessage() for r in caplog.records if r.name == "lab.core.runfiles"]
            assert any(f"{path}, line {line}: incomplete last line left out" in m for m in said), (k, said)


@pytest.mark.parametrize("filename", ["steps.csv", "fp8_census.csv", "fp8_amax.csv"])
def test_a_live_runs_incomplete_last_line_is_left_out_and_said(filename, run, tmp_path, capsys, caplog):
    """A run still training (no metrics.json): `lab inspect` (and the histories) read every whole line."""
    names = [n for n in READERS[filename] if n != "diagnose"]  # diagnose needs metrics.json: a finished run
    live_cuts(run, tmp_path, filename, False, names, capsys, caplog)


def test_a_crashed_runs_step_stream_is_diagnosed_up_to_its_last_whole_line(run, tmp_path, capsys, caplog):
    """A run that stopped with metrics.json but never published steps.csv: its stream's cut line is not damage."""
    live_cuts(run, tmp_path, "steps.csv", True, ["diagnose", "inspect"], capsys, caplog)


@pytest.mark.parametrize("keep", [0.5, -1])
def test_a_cut_tensors_file_is_refused_in_one_line(keep, run, tmp_path, capsys):
    """fp8_operands.pt (binary, no lines: whole or damaged) cut short: `lab replay` refuses it naming the file."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "fp8_operands.pt"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)] if keep > 0 else data[:keep])
    code = cli.main(["replay", str(copy), "--recipe", "fp8-rowwise"])
    captured = capsys.readouterr()
    refused(code, captured.err, path, None)

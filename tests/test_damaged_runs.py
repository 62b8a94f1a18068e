"""A damaged run directory is refused in one line, and the lab's files land with the umask's mode.

Each command that reads a run directory (inspect, diagnose, replay, figures, aggregate) is given a copy of a good
run in which one file it reads (steps.csv, census.csv, metrics.json, config.yaml) is damaged three ways: its last
line cut (a copy or sync that stopped early), emptied, or replaced by binary bytes. Each must exit non-zero with
exactly one line on stderr naming the file, and no traceback (lab/core/runfiles.py reads every such file). The
commands run in-process (`lab.cli.main`, stderr captured); one case also runs as a real `python -m lab` process.

Not damage: `steps.csv.partial`, the stream a live run appends to, ending inside a line (it is half-written by
design), which `inspect` and `replay` read up to its last whole line.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lab
from lab import cli
from lab.core import files

from conftest import REPO
from results_fixture import make_run

# one seed per mode: aggregate's spread over seeds is undefined (numpy says so), which is not what is tested here
pytestmark = pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
STUDY_RUNS = [("m", "fp32", 0), ("m", "fp16-dynamic", 0)]   # the damaged one: the last
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xd8\xff\xe0\x00\x10JFIF garbage\n"


def cut(path: Path) -> None:
    """The last line cut in half, its end of line gone (as "12,0.5," from "12,0.5,1024,0,0\\n")."""
    text = path.read_text().rstrip("\n")
    last = text.rsplit("\n", 1)[-1]
    path.write_text(text[:len(text) - max(1, len(last) // 2)])


def cut_end(path: Path) -> None:
    """Only the end of line and the last character gone: every field still there, the last one shorter (a CSV or
    YAML file still parses, into a wrong value; only the missing end of line tells)."""
    path.write_text(path.read_text().rstrip("\n")[:-1])


DAMAGES = {"cut": cut, "cut-end": cut_end, "empty": lambda p: p.write_bytes(b""),
           "garbage": lambda p: p.write_bytes(BINARY)}

#: command -> the files of a run directory it reads
READS = {
    "inspect": ("steps.csv", "metrics.json"),
    "diagnose": ("steps.csv", "census.csv", "metrics.json", "config.yaml"),
    "replay": ("steps.csv", "config.yaml"),
    "figures": ("steps.csv", "census.csv", "metrics.json", "config.yaml"),  # config.yaml: of a run not finished
    "aggregate": ("steps.csv", "metrics.json"),
}
CASES = [(c, f, d) for c, names in READS.items() for f in names for d in DAMAGES]


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A small FP16 loop under torch's GradScaler recorded with lab.record: every file, census included."""
    out = tmp_path_factory.mktemp("damaged") / "rec"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
    g = torch.Generator().manual_seed(1)
    with lab.record(model, scaler, out=out, census_every=2, log_every=2) as rec:
        for _ in range(8):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """A results folder of two synthetic runs (tests/results_fixture.py) for figures and aggregate."""
    root = tmp_path_factory.mktemp("damaged-study")
    for model, mode, seed in STUDY_RUNS:
        make_run(root / "runs" / model / mode / f"seed{seed}", model, mode, seed)
    return root


def command(name: str, recording: Path, study: Path, work: Path) -> tuple[list[str], Path]:
    """(argv, the run directory whose files the case damages) for a copy of the good runs under ``work``."""
    if name in ("inspect", "diagnose", "replay"):
        run = work / "rec"
        shutil.copytree(recording, run)
        return [name, str(run)], run
    shutil.copytree(study / "runs", work / "runs")
    runs = [work / "runs" / m / mode / f"seed{s}" for m, mode, s in STUDY_RUNS]
    if name == "figures":
        return ["figures", "--runs", *map(str, runs), "--out", str(work / "figures")], runs[-1]
    return ["aggregate", *map(str, runs), "--csv", str(work / "summary.csv"), "--md", str(work / "summary.md")], \
        runs[-1]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", list(READS))
def test_the_good_runs_are_read(name, recording, study, tmp_path, capsys):
    """The baseline: each command answers the undamaged copy (so a refusal below is the damage's doing)."""
    argv, _ = command(name, recording, study, tmp_path)
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "error" not in err
    assert (tmp_path / "summary.csv").is_file() if name == "aggregate" else out


@pytest.mark.parametrize("name, filename, damage", CASES)
def test_a_damaged_file_is_refused_in_one_line(name, filename, damage, recording, study, tmp_path, capsys):
    argv, run = command(name, recording, study, tmp_path)
    path = run / filename
    if name == "figures" and filename == "config.yaml":  # figures reads config.yaml of a run without metrics.json
        (run / "metrics.json").unlink()
    DAMAGES[damage](path)
    code, out, err = run_cli(argv, capsys)
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], err
    assert "Traceback" not in err
    if damage.startswith("cut"):  # where the file was cut (a JSON file: where it stopped parsing)
        assert ", line " in lines[0], err
    if name == "aggregate":  # nothing written from a study with a damaged run
        assert not (tmp_path / "summary.csv").exists() and not (tmp_path / "summary.md").exists()
    if name == "figures":
        assert not (tmp_path / "figures").exists()


def test_the_real_command_prints_one_line(recording, tmp_path):
    """As a shell sees it: `python -m lab inspect` on a finished run whose steps.csv was cut."""
    run = tmp_path / "rec"
    shutil.copytree(recording, run)
    cut(run / "steps.csv")
    res = subprocess.run([sys.executable, "-m", "lab", "inspect", str(run)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and str(run / "steps.csv") in res.stderr and "cut short" in res.stderr


@pytest.mark.parametrize("name", ["inspect", "replay"])
def test_a_live_runs_half_written_line_is_not_damage(name, recording, tmp_path, capsys):
    """A run still training: no metrics.json, steps.csv.partial whose last line is being written. inspect and
    replay read its whole lines; the same cut in a published steps.csv is damage (above)."""
    run = tmp_path / "rec"
    shutil.copytree(recording, run)
    (run / "metrics.json").unlink()
    (run / "steps.csv").rename(run / "steps.csv.partial")
    whole = len((run / "steps.csv.partial").read_text().splitlines()) - 1   # rows
    cut(run / "steps.csv.partial")
    if name == "inspect":
        code, out, err = run_cli(["inspect", str(run), "--json"], capsys)
        assert code == 0, err
        state = json.loads(out)
        assert state["steps"] == whole - 1 and not state["finished"]
    else:
        code, out, err = run_cli(["replay", str(run), "--policy", "dynamic", "--json"], capsys)
        assert code == 0, err
        assert f'"steps": {whole - 1}' in out
    # an empty stream (nothing flushed yet) is a run with no step yet, not damage
    (run / "steps.csv.partial").write_bytes(b"")
    if name == "inspect":
        assert run_cli(["inspect", str(run)], capsys)[1].strip().endswith("no step recorded yet")


# --- the mode of what the lab writes ----------------------------------------------------------------------
@pytest.fixture
def umask():
    """Set the process umask for a test; the old one is put back after."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_land_with_the_umasks_mode(mask, mode, umask, tmp_path):
    """tempfile.mkstemp's 0600 no longer carries over to the file: a new file's mode under the umask, as open()
    gives (a study on a shared cluster is readable by the group where the umask says so)."""
    umask(mask)
    files.atomic_write_text(tmp_path / "t" / "summary.md", "x\n")
    files.atomic_write(tmp_path / "t" / "w.bin", lambda f: f.write(b"\x00"), mode="wb")
    files.atomic_write_json(tmp_path / "t" / "metrics.json", {"a": 1})
    import matplotlib
    matplotlib.use("Agg")
    from lab.report.figures import new_figure, save
    fig = new_figure(2, 2)
    fig.add_subplot().plot([0, 1])
    save(fig, tmp_path / "t" / "fig.png")
    with open(tmp_path / "t" / "plain.txt", "w") as f:  # what the kernel gives a plain new file
        f.write("x")
    for name in ("summary.md", "w.bin", "metrics.json", "fig.png", "plain.txt"):
        assert stat.S_IMODE((tmp_path / "t" / name).stat().st_mode) == mode, name
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == sorted(
        ["summary.md", "w.bin", "metrics.json", "fig.png", "plain.txt"])   # no temporary file left


def test_a_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        files.atomic_write(tmp_path / "x.txt", lambda f: (_ for _ in ()).throw(RuntimeError("boom")))
    assert list(tmp_path.iterdir()) == []


def test_provenance_names_the_commit_of_a_tree_without_git(tmp_path, monkeypatch):
    """A copy of the tree with no .git (the GPU machine's): the commit comes from LAB_GIT_COMMIT, its state unknown;
    inside a repository git answers, whatever the variable says."""
    from lab.core import files
    monkeypatch.setenv(files.GIT_COMMIT_ENV, "0123abc")
    assert files.git_commit(tmp_path) == {"commit": "0123abc", "dirty": None}
    monkeypatch.delenv(files.GIT_COMMIT_ENV)
    assert files.git_commit(tmp_path) == {"commit": None, "dirty": None}
    monkeypatch.setenv(files.GIT_COMMIT_ENV, "0123abc")
    here = files.git_commit()
    assert here["commit"] != "0123abc" and len(here["commit"]) == 40

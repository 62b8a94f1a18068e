"""Bad input is refused before work starts.

Every kind of bad input below goes through `python -m lab train` as a user would type it (the config is a small
study written to tmp_path) and must give: exit status 2; one line on stderr, and no traceback, naming the key or
path, what was expected and what was found; and nothing left behind (the folder given as --out, and everything
else under tmp_path, exactly as before: no run directory, no config.yaml, no metrics.json, no checkpoint).

The table runs in-process (`lab.cli.main`, stderr captured), which keeps ~40 cases to a few seconds; the cases in
SUBPROCESS also run as a real `python -m lab train` process, for the exit status and stderr as a shell sees them.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from lab import cli
from lab.core.config import resolve_run, validate_study

from conftest import REPO, tiny_study


# --- what the cases build ---------------------------------------------------------------------------------
def set_scaler(mode: str, **params):
    """A study edit: mode `mode` with a loss-scaling policy and parameters (added if the study lacks it)."""
    def edit(study, tmp):
        study["modes"][mode] = {"precision": "fp16", "scaler": params}
    return edit


def set_key(*path, value):
    def edit(study, tmp):
        node = study
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(tmp) if callable(value) else value
    return edit


def image_data(name: str, make: Callable[[Path], Path]):
    """A study edit: every family reads `name` from the folder `make(tmp)` builds."""
    def edit(study, tmp):
        study["data"].update(name=name, path=str(make(tmp)))
    return edit


def text_data(make: Callable[[Path], Path], context: int = 16):
    """A study edit: a language-model family `lm` on the text corpus `make(tmp)` builds."""
    def edit(study, tmp):
        study["models"]["lm"] = {"preset": "gpt-tiny", "data": {"name": "text", "path": str(make(tmp)),
                                                                "context": context, "vocab_size": 64}}
    return edit


def policy_file(source: str | None):
    """A study edit: policy_modules names a file holding `source` (None: a file that is not there)."""
    def edit(study, tmp):
        folder = tmp / "policies"
        folder.mkdir(exist_ok=True)
        path = folder / f"user_policy_{abs(hash(source)) % 10**8}_{tmp.name}.py"  # a fresh module per test
        if source is not None:
            path.write_text(source)
        study["policy_modules"] = [str(path)]
    return edit


def empty_folder(tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty"


def cifar_folder(tmp, truncate: str | None = None):
    """A tiny cifar-10-batches-py folder (4 images a batch); `truncate`: that batch file cut in half."""
    folder = tmp / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    if truncate:
        blob = (folder / truncate).read_bytes()
        (folder / truncate).write_bytes(blob[: len(blob) // 2])
    return folder


def imagenet_folder(tmp, corrupt: bool = False):
    """train/ and val/ with two classes of real PNGs; `corrupt`: one more "JPEG" that is not an image."""
    root = tmp / "imagenet"
    for split in ("train", "val"):
        for k, cls in enumerate(("ant", "bee")):
            (root / split / cls).mkdir(parents=True)
            Image.new("RGB", (20, 20), (90 * k, 40, 200)).save(root / split / cls / "img0.png")
    if corrupt:
        (root / "train" / "bee" / "broken.jpg").write_bytes(b"\xff\xd8 this is not a JPEG " * 8)
    return root


def small_corpus(tmp):
    path = tmp / "small.txt"
    path.write_text("one two three four\n\nfive six seven eight\n\nnine ten eleven\n")
    return path


def unreadable(make: Callable[[Path], Path]):
    def build(tmp):
        path = make(tmp)
        path.chmod(0)
        return path
    return build


def other_config_run(tmp, checkpoint_only: bool = False):
    """--out holding another configuration's run (lr 1e-4 instead of the study's): its config.yaml,
    metrics.json and steps.csv, or (checkpoint_only) just a checkpoint that names its config hash."""
    run_dir = tmp / "run"
    (run_dir / "checkpoint").mkdir(parents=True)
    other = tiny_study()
    other["train"]["lr"] = 1e-4
    cfg = resolve_run(validate_study(other), "vit", "fp32", 0)
    if checkpoint_only:
        torch.save({"config_hash": cfg.hash(), "step": 2}, run_dir / "checkpoint" / "step00000002.pt")
    else:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        (run_dir / "metrics.json").write_text(json.dumps({"config_hash": cfg.hash(), "status": "ok"}))
        (run_dir / "steps.csv").write_text("step,loss\n0,2.3\n")
    return run_dir, cfg.hash()


def this_hash():
    return resolve_run(validate_study(tiny_study()), "vit", "fp32", 0).hash()


# --- the table --------------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    expect: tuple[str, ...]             # fragments of the one line; "{tmp}" is the test's tmp_path
    edit: Callable | None = None        # change the study before it is written to study.yaml
    args: tuple[str, ...] = ()          # more command-line arguments ("{tmp}" allowed)
    model: str = "vit"
    mode: str = "fp32"
    seed: str = "0"
    out: Callable | None = None         # prepare --out; returns (path, expected fragments) (default: absent)
    chmod: Callable | None = None       # build something made unreadable/unwritable: skipped where that fails


def run_dir_case(checkpoint_only):
    def out(tmp):
        path, other = other_config_run(tmp, checkpoint_only)
        return path, (other, this_hash())
    return out


def out_file(tmp):
    (tmp / "taken").write_text("not a folder")
    return tmp / "taken", ()


def out_under_file(tmp):
    (tmp / "taken").write_text("not a folder")
    return tmp / "taken" / "run", (f"found a file at {tmp / 'taken'}",)


def out_unwritable(tmp):
    (tmp / "locked").mkdir()
    (tmp / "locked").chmod(0o555)
    return tmp / "locked" / "run", ("expected a folder this user can write into", str(tmp / "locked"))


CASES = [
    # names the command line or the config gives
    Case("unknown-model", ("--model", "unknown model 'resnet5'", "did you mean 'resnet50'", "resnet50, vit"),
         model="resnet5"),
    Case("unknown-mode", ("--mode", "unknown mode 'fp16-static12'", "did you mean 'fp16-static128'",
                          "fp32, fp16-static128"), mode="fp16-static12"),
    Case("unknown-policy", ("modes.fp16-static128.scaler.policy", "found 'statc'", "did you mean 'static'",
                            "dynamic", "hysteresis"),
         edit=set_scaler("fp16-static128", policy="statc", scale=128)),
    Case("unknown-preset", ("models.vit.preset", "expected a known preset", "found 'vit-tiny-digit'",
                            "did you mean 'vit-tiny-digits'"),
         edit=set_key("models", "vit", "preset", value="vit-tiny-digit")),
    Case("unknown-precision", ("modes.fp32.precision", "expected one of fp32, fp16, bf16", "found 'fp8'"),
         edit=set_key("modes", "fp32", "precision", value="fp8")),
    # loss-scale parameters
    Case("scale-zero", ("modes.fp16-static128.scaler", "scale must be > 0", "got 0"),
         edit=set_scaler("fp16-static128", policy="static", scale=0)),
    Case("scale-negative", ("modes.fp16-static128.scaler", "scale must be > 0", "got -1"),
         edit=set_scaler("fp16-static128", policy="static", scale=-1)),
    Case("scale-nan", ("modes.fp16-static128.scaler", "scale must be finite", "got nan"),
         edit=set_scaler("fp16-static128", policy="static", scale=float("nan"))),
    Case("scale-inf", ("modes.fp16-static128.scaler", "scale must be finite", "got inf"),
         edit=set_scaler("fp16-static128", policy="static", scale=float("inf"))),
    Case("scale-string", ("modes.fp16-static128.scaler", "scale must be a real number", "got 'big'"),
         edit=set_scaler("fp16-static128", policy="static", scale="big")),
    Case("growth-factor-1", ("modes.fp16-dynamic.scaler", "growth factor must be > 1.0", "found growth_factor=1.0"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", growth_factor=1.0)),
    Case("growth-factor-below-1", ("modes.fp16-dynamic.scaler", "growth factor must be > 1.0",
                                   "found growth_factor=0.5"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", growth_factor=0.5)),
    Case("backoff-1", ("modes.fp16-dynamic.scaler", "backoff factor must be < 1.0", "found backoff_factor=1.0"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", backoff_factor=1.0)),
    Case("backoff-0", ("modes.fp16-dynamic.scaler", "backoff_factor must be > 0", "got 0"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", backoff_factor=0)),
    Case("backoff-negative", ("modes.fp16-dynamic.scaler", "backoff_factor must be > 0", "got -0.5"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", backoff_factor=-0.5)),
    Case("growth-interval-fractional", ("modes.fp16-dynamic.scaler", "growth_interval must be an int", "got 2.5"),
         edit=set_scaler("fp16-dynamic", policy="dynamic", growth_interval=2.5)),
    # keys and seeds
    Case("unknown-top-level-key", ("<top level>: unknown key(s) 'seed'", "did you mean 'seeds'", "allowed keys"),
         edit=set_key("seed", value=[0])),
    Case("unknown-train-key", ("train: unknown key(s) 'epoch'", "did you mean 'epochs'", "allowed keys"),
         edit=set_key("train", "epoch", value=2)),
    Case("config-integer-as-float", ("train.epochs", "expected an integer", "found 2.0"),
         edit=set_key("train", "epochs", value=2.0)),
    Case("seed-negative", ("seeds[0]", "expected a value >= 0", "found -1"), edit=set_key("seeds", value=[-1])),
    Case("seed-repeated", ("seeds", "expected distinct values", "found 0 more than once"),
         edit=set_key("seeds", value=[0, 1, 0])),
    Case("cli-seed-negative", ("--seed", "expected an integer >= 0", "found -1"), seed="-1"),
    Case("config-file-missing", ("config file {tmp}/nope.yaml", "expected a YAML file", "found nothing"),
         args=("--config", "{tmp}/nope.yaml")),
    # data
    Case("data-path-missing", ("data.path", "expected the cifar10 data folder", "{tmp}/no-cifar",
                               "does not exist"),
         edit=image_data("cifar10", lambda tmp: tmp / "no-cifar")),
    Case("data-folder-empty", ("cifar10 path {tmp}/empty", "expected a 'cifar-10-batches-py' folder",
                               "found an empty folder"),
         edit=image_data("cifar10", empty_folder)),
    Case("data-imagenet-empty", ("imagenet folder {tmp}/empty/train", "expected a class-per-folder directory",
                                 "found nothing there"),
         edit=image_data("imagenet", empty_folder)),
    Case("data-folder-unreadable", ("cifar10 data path {tmp}/cifar-10-batches-py",
                                    "expected a folder this user can read", "mode 0"),
         edit=image_data("cifar10", unreadable(cifar_folder)), chmod=lambda tmp: tmp / "cifar-10-batches-py"),
    Case("data-corrupt-image", ("image file {tmp}/imagenet/train/bee/broken.jpg", "expected an image",
                                "PIL cannot identify"),
         edit=image_data("imagenet", lambda tmp: imagenet_folder(tmp, corrupt=True))),
    Case("data-cifar-truncated", ("cifar10 batch file {tmp}/cifar-10-batches-py/data_batch_3",
                                  "expected a pickled CIFAR-10 batch", "found a truncated file"),
         edit=image_data("cifar10", lambda tmp: cifar_folder(tmp, truncate="data_batch_3"))),
    Case("text-corpus-too-small", ("text corpus {tmp}/small.txt", "expected at least data.context + 1 = 17 tokens",
                                   "found"),
         edit=text_data(small_corpus), model="lm"),
    Case("text-folder-empty", ("text corpus {tmp}/empty", "expected .txt files", "found none"),
         edit=text_data(empty_folder), model="lm"),
    # the output directory
    Case("out-not-writable", ("run directory {tmp}/locked/run", "mode 555"), out=out_unwritable,
         chmod=lambda tmp: tmp / "locked"),
    Case("out-is-a-file", ("run directory {tmp}/taken: expected a folder, found a file",), out=out_file),
    Case("out-under-a-file", ("run directory {tmp}/taken/run", "expected a folder or a path where one can be made"),
         out=out_under_file),
    Case("out-holds-other-config-run", ("run directory {tmp}/run holds a run of config", "this run is config"),
         out=run_dir_case(checkpoint_only=False)),
    Case("out-holds-other-config-checkpoint", ("checkpoint {tmp}/run/checkpoint/step00000002.pt belongs to config",
                                               "this run's config is"),
         out=run_dir_case(checkpoint_only=True)),
    # --set
    Case("set-unknown-key", ("--set train.epoch", "unknown key 'epoch'", "did you mean 'epochs'"),
         args=("--set", "train.epoch=2")),
    Case("set-unknown-section", ("--set trian.epochs", "unknown key 'trian'", "did you mean 'train'"),
         args=("--set", "trian.epochs=2")),
    Case("set-wrong-type", ("--set", "train.epochs", "expected an integer", "found 'abc'"),
         args=("--set", "train.epochs=abc")),
    Case("set-fractional-integer", ("--set", "train.batch_size", "expected an integer", "found 2.5"),
         args=("--set", "train.batch_size=2.5")),
    Case("accum-longer-than-an-epoch", ("train.accum_steps", "expected at most the", "found 999"),
         args=("--set", "train.accum_steps=999")),
    Case("fault-unknown-module", ("train.faults[0].module", "expected a leaf module", "found 'nope'"),
         args=("--set", "train.faults=[{{step: 1, into: activation_grad, module: nope, value: inf}}]")),
    Case("set-bad-enum", ("--set", "mode.precision", "expected one of fp32, fp16, bf16", "found 'fp61'",
                          "did you mean 'fp16'"), args=("--set", "mode.precision=fp61")),
    Case("set-bad-scale", ("--set: mode.scaler", "scale must be finite", "got inf"),
         mode="fp16-static128", args=("--set", "mode.scaler.scale=.inf")),
    # policy_modules
    Case("policy-module-missing-file", ("policy_modules: expected a Python file at {tmp}/policies/",
                                        "found nothing there"),
         edit=policy_file(None)),
    Case("policy-module-import-error", ("policy_modules", "expected a module that imports",
                                        "ModuleNotFoundError", "no_such_package_for_lab"),
         edit=policy_file("import no_such_package_for_lab\n")),
    Case("policy-module-registers-nothing", ("policy_modules", "expected a module that registers a loss-scaling "
                                             "policy", "found none"),
         edit=policy_file("from lab.scaling import ScalingPolicy\n\nclass Forgotten(ScalingPolicy):\n"
                          "    def update(self, scale, found_inf, step, grad_norm=None):\n        return scale\n")),
    Case("policy-module-not-importable", ("policy_modules", "cannot import 'no_such_policy_module_for_lab'",
                                          "expected an importable module", "ModuleNotFoundError"),
         edit=set_key("policy_modules", value=["no_such_policy_module_for_lab"])),
]
SUBPROCESS = ["unknown-train-key", "scale-nan", "set-wrong-type", "data-cifar-truncated", "out-holds-other-config-run",
              "policy-module-registers-nothing"]


def snapshot(root: Path) -> dict:
    """Every file and folder under root with its bytes (bytecode caches of imported policy files aside)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.parts:
            continue
        rel = p.relative_to(root).as_posix()
        try:
            out[rel] = p.read_bytes() if p.is_file() else "<dir>"
        except PermissionError:
            out[rel] = "<unreadable>"
    return out


def prepare(case: Case, tmp: Path):
    """(argv, expected fragments, tmp snapshot before) for one case."""
    study = tiny_study()
    study["modes"]["fp16-dynamic"] = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    if case.edit:
        case.edit(study, tmp)
    config = tmp / "study.yaml"
    config.write_text(yaml.safe_dump(study, sort_keys=False))
    out, more = case.out(tmp) if case.out else (tmp / "run", ())
    if case.chmod is not None and os.geteuid() != 0:
        if os.access(case.chmod(tmp), os.R_OK | os.W_OK | os.X_OK):
            pytest.skip(f"uid {os.getuid()} can still use a path whose permission bits are 0: an unreadable or "
                        f"unwritable path cannot be made here")
    argv = ["train", "--model", case.model, "--mode", case.mode, "--seed", case.seed, "--out", str(out),
            "--config", str(config), *(a.format(tmp=tmp) for a in case.args)]
    expect = [f.format(tmp=tmp) for f in case.expect] + list(more)
    return argv, expect, snapshot(tmp), out


def check_refusal(rc: int, stderr: str, expect, before: dict, tmp: Path, out: Path):
    assert rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    message = lines[-1]
    assert message.startswith("error: "), stderr
    for fragment in expect:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    if out.relative_to(tmp).as_posix() not in before:
        assert not out.exists(), f"a refused run left {out} behind"
    assert snapshot(tmp) == before, "a refused run must leave everything as it was (no config.yaml, no metrics.json)"
    return message


NOBODY = 65534
# Root reads and writes whatever the permission bits say, so as root the permission cases run the command as
# user `nobody`: the lab (and everything a refusal imports) is imported first, then the effective ids dropped.
AS_NOBODY = f"""
import os, sys
from lab import cli, scaling
from lab.core import config
from lab.data import datasets as data, text
from lab.models import presets as models
from lab.run import checkpoint, rundir, train
import PIL.Image, torchvision.datasets
os.setegid({NOBODY}); os.seteuid({NOBODY})
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture
def workdir(request, tmp_path):
    """tmp_path, or as root for a permission case, a folder that `nobody` can reach and write into."""
    params = request.node.callspec.params
    case = params["case"] if "case" in params else BY_ID[params["kind"]]
    if case.chmod is None or os.geteuid() != 0:
        folder = tmp_path
    else:
        folder = Path(tempfile.mkdtemp(prefix="lab-bad-input-"))
        folder.chmod(0o777)
    yield folder
    for p in [folder, *folder.rglob("*")]:  # give back what a case locked, so the folder can be removed
        if not p.is_symlink():
            p.chmod(0o755)
    if folder != tmp_path:
        shutil.rmtree(folder)


def run_refused(argv, case, capsys) -> tuple[int, str]:
    if case.chmod is not None and os.geteuid() == 0:
        done = subprocess.run([sys.executable, "-c", AS_NOBODY, *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        if "Operation not permitted" in done.stderr:
            pytest.skip("running as root without the right to change the effective uid: cannot run as nobody")
        return done.returncode, done.stderr
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


# every kind of bad input the lab promises to refuse: each is run below by name, so a case that goes missing from
# the table is an error, not a silent gap (the table may hold more)
KINDS = ("unknown-model", "unknown-mode", "unknown-policy", "unknown-preset", "scale-zero", "scale-negative",
         "scale-nan", "scale-inf", "scale-string", "growth-factor-1", "backoff-1", "backoff-0",
         "growth-interval-fractional", "unknown-top-level-key", "unknown-train-key", "seed-negative",
         "seed-repeated", "data-path-missing", "data-folder-empty", "data-folder-unreadable",
         "data-corrupt-image", "data-cifar-truncated", "text-corpus-too-small", "out-not-writable",
         "out-is-a-file", "out-holds-other-config-run", "set-unknown-key", "set-wrong-type",
         "policy-module-missing-file", "policy-module-registers-nothing")
BY_ID = {c.id: c for c in CASES}
ORDER = list(KINDS) + [c.id for c in CASES if c.id not in KINDS]


@pytest.mark.parametrize("kind", ORDER)
def test_bad_input_is_refused_in_one_line(kind, workdir, capsys):
    case = BY_ID[kind]
    argv, expect, before, out = prepare(case, workdir)
    rc, err = run_refused(argv, case, capsys)
    check_refusal(rc, err, expect, before, workdir, out)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS], ids=SUBPROCESS)
def test_bad_input_refused_by_the_real_command(case, workdir):
    """As a shell sees it: exit status 2 and stderr holding exactly one line."""
    argv, expect, before, out = prepare(case, workdir)
    done = subprocess.run([sys.executable, "-m", "lab", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    message = check_refusal(done.returncode, done.stderr, expect, before, workdir, out)
    assert done.stderr == message + "\n", done.stderr
    assert done.stdout == ""

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent

torch.set_num_threads(1)
# benchmarks/gpu/gpu_check.sh: every CUDA synchronisation in the device tests warned about (or "error")
if os.environ.get("LAB_CUDA_SYNC_DEBUG") and torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode(os.environ["LAB_CUDA_SYNC_DEBUG"])
# what the lab remembers between runs (checked image headers) goes to a folder of the suite's own, not ~/.cache
os.environ.setdefault("LAB_CACHE_DIR", tempfile.mkdtemp(prefix="lab-test-cache-"))
# the quantizers' eager steps (lab/formats/kernels.py): each compiled graph costs seconds the first time;
# tests/test_formats_kernels.py compiles them and checks they give the same bits
os.environ.setdefault("LAB_COMPILED_QUANTIZERS", "0")

#: devices the device-parametrised tests run on: CUDA joins on a machine that has it (field notes: a GPU is
#: lent to some sessions only; `pytest -k cuda` there runs exactly the CUDA cases)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: the same for tests whose runs record their device: the CUDA case carries the `cuda` mark the CPU guard honours
RUN_DEVICES = [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES]


# The files whose tests run whole studies, torchrun jobs or kill-and-resume cycles: `make test` runs the suite on
# as many processes as the machine has CPUs (pytest-xdist, one file per process at a time), and a long file
# started last would finish alone; these start first, longest first (--no-loadscope-reorder in pyproject.toml:
# xdist would otherwise order files by their number of tests, and the two-test study_kill.py started last).
LONG_FILES = ("test_workflow.py", "test_study_kill.py", "test_distributed.py", "test_resume.py",
              "test_claims.py", "test_fsdp.py", "test_gpu_check.py", "test_sizing.py", "test_jobs.py",
              "test_doc_claims.py",
              "test_bad_input.py",
              "test_faults.py", "test_figures.py", "test_bench_throughput.py", "test_trust.py", "test_gpu_guard.py",
              "test_notebooks.py", "test_lora.py", "test_diagnose.py", "test_train.py", "test_deepspeed_policy.py",
              "test_calibration.py", "test_multimodal.py", "test_diagnose_branch.py", "test_slurm_resources.py",
              "test_record.py", "test_tokens.py",
              "test_fp16_loss.py", "test_presets.py", "test_emulated_accum.py", "test_integrations_hf.py",
              "test_monitor.py", "test_fp16_cpu_mutants.py", "test_integrations_peft.py",
              "test_integrations_lightning.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: order within a file kept
    for item in items:  # the `device` fixture's CUDA cases ask for CUDA: the guard below lets their runs be there
        if getattr(getattr(item, "callspec", None), "params", {}).get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)


def _device_values(obj):
    """Every value under a `device` (or `*_device`) key, at any depth: a string, or a torch.device-like
    {"type": ...} mapping."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and (key == "device" or key.endswith("_device")):
                if isinstance(value, str):
                    yield value
                elif isinstance(value, dict) and isinstance(value.get("type"), str):
                    yield value["type"]
            yield from _device_values(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _device_values(value)


def recorded_devices(folder: Path) -> set[str]:
    """The devices that the files under ``folder`` recorded: every device field of every JSON file (metrics.json,
    provenance.json, job records) and run config (config.yaml), at any depth."""
    found = set()
    for pattern, load in (("*.json", json.loads), ("config.yaml", yaml.safe_load)):
        for f in folder.rglob(pattern):
            try:
                found.update(_device_values(load(f.read_text())))
            except (OSError, ValueError, yaml.YAMLError, UnicodeDecodeError):
                continue
    return found


def _gpu_runs(folder: Path) -> list[str]:
    return sorted(d for d in recorded_devices(folder) if d.startswith("cuda"))


#: tmp folders the per-test check has seen (or exempted: a test marked cuda): the module-level check skips them
_CHECKED: set = set()


@pytest.fixture(autouse=True)
def runs_stay_on_the_cpu(request, tmp_path_factory):
    """A test not marked `cuda` fails if a run it made recorded a GPU: such a test means the CPU, and on a machine
    with a GPU an unpinned `device: auto` would silently move it there (tests/test_gpu_guard.py shows it firing).
    The folders a marked test makes (its tmp_path, or its own tmp_path_factory folders) are exempt, here and in the
    module-level check below."""
    cuda = request.node.get_closest_marker("cuda") is not None
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir()) if cuda else set()
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if cuda:
        _CHECKED.update(set(base.iterdir()) - before)
        return
    if tmp is None:
        return
    _CHECKED.add(Path(tmp))
    gpus = _gpu_runs(Path(tmp))
    if gpus:
        pytest.fail(f"a run of this CPU test landed on {gpus}: pin device: cpu (or mark the test cuda)")


@pytest.fixture(scope="module", autouse=True)
def module_runs_stay_on_the_cpu(request, tmp_path_factory):
    """The same check for the folders a module's fixtures made (tmp_path_factory: runs shared by a module's tests),
    after the module's last test; a module whose tests are all marked cuda is exempt."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.get_closest_marker("cuda"):
        return
    for folder in sorted(set(base.iterdir()) - before):
        # (pytest's `<name>current` entries are links to numbered folders the loop sees itself)
        if folder.is_dir() and not folder.is_symlink() and folder not in _CHECKED:
            gpus = _gpu_runs(folder)
            if gpus:
                pytest.fail(f"runs made under {folder} by {request.node.name} landed on {gpus}: pin device: cpu "
                            "(or mark the test cuda)")


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


class CountingSGD(torch.optim.SGD):
    """SGD that counts how often step() actually ran (did the scaler skip it?)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


class SyncCounter:
    """Counts the Tensor methods that copy a value to the host."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *a, _orig=orig, _name=name, **k):
                self.calls.append(_name)
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, wrapper)


def count_contract_calls(monkeypatch) -> dict:
    """Counts, per torch function, the calls the CPU tensor-core contract computed itself (lab.numerics.contract):
    a run's `fp16_path` label says the contract was meant; these counts say it was active."""
    from lab.numerics import contract
    calls: dict = {}
    for func, handler in list(contract._HANDLERS.items()):
        def counted(dt, a, kw, _h=handler, _f=func):
            calls[_f] = calls.get(_f, 0) + 1
            return _h(dt, a, kw)
        monkeypatch.setitem(contract._HANDLERS, func, counted)
    return calls


def tiny_study(**overrides) -> dict:
    """The default study shrunk to seconds: small inputs, a few optimizer steps, two modes."""
    study = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    study["device"] = "cpu"  # the default's `auto` would move these runs to a GPU where there is one
    study["seeds"] = [0]
    study["data"]["image_size"] = 16
    study["train"].update(epochs=1, max_steps=3, batch_size=32, log_every=1)
    study["models"] = {"resnet50": {"preset": "resnet50-digits"}, "vit": {"preset": "vit-tiny-digits"}}
    study["modes"] = {"fp32": {"precision": "fp32"},
                      "fp16-static128": {"precision": "fp16", "scaler": {"policy": "static", "scale": 128}}}
    study["compare"] = []  # the default study's pairs name its own modes
    for key, value in overrides.items():
        study[key] = value
    return study


@pytest.fixture
def tiny():
    return copy.deepcopy(tiny_study())


@pytest.fixture
def repo_copy(tmp_path):
    """A copy of the workflow and package in a temporary folder (what a user's clone holds)."""
    dest = tmp_path / "lab-copy"
    dest.mkdir()
    for name in ("Snakefile", "workflow", "lab", "configs", "profiles"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)
    return dest


def load_benchmark(path: str):
    """benchmarks/PATH.py (e.g. "speed/bench_step") imported as a module named after the file (the folders hold
    scripts, not packages)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1], REPO / "benchmarks" / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_thread_pool() -> None:
    """In a process forked from this one, before it starts a thread: torch's CPU thread pool made anew on this thread.

    After a fork the pool the parent left is dead, and torch replaces it on the first call that needs it. Two threads
    making that first call at once (gloo's or autograd's and this one) can find no pool at all ("Invalid thread pool!",
    the child aborted: seen once in test_fsdp.py's ranks). torch.set_num_threads makes the call here, alone."""
    torch.set_num_threads(torch.get_num_threads())


def forked_ranks(argv: list[str], nproc: int, env: dict | None = None):
    """`torchrun --standalone --nproc-per-node nproc -m lab <argv>` without torchrun: each rank a process forked
    from this warm one with the variables torchrun sets, running lab.cli.main. The lab reads only those variables
    (lab/run/distributed.py from_env), so the ranks run the lab's code as torchrun's would; a fresh interpreter per
    rank and for the launcher cost ~4 s each of importing torch. Tests of the launcher itself (its signals, its
    report of a failed rank, the workflow's command) use torchrun. Returns the exit status (the first rank's that
    failed, else 0) and each rank's stdout and stderr joined, rank 0's first, as subprocess.run's result has them."""
    import os
    import socket
    import sys
    import tempfile
    import types
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rank_env(rank: int) -> dict:
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GROUP_RANK": "0",
                "TORCHELASTIC_RUN_ID": "forked"} if nproc > 1 else {}

    def read(f) -> str:
        f.seek(0)
        text = f.read().decode(errors="replace")
        f.close()
        return text
    logs, pids = [], []
    for rank in range(nproc):
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.environ.update({**(env or {}), **rank_env(rank)})
                tempfile.tempdir = None  # TMPDIR read again: rank 1's scratch folder goes where env says
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                from lab.cli import main
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code or 0)
        logs.append((out, err))
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return types.SimpleNamespace(returncode=next((c for c in codes if c), 0),
                                 stdout="".join(read(out) for out, _ in logs),
                                 stderr="".join(read(err) for _, err in logs))


def assert_valid_diagnosis(d) -> None:
    """`lab diagnose --json`'s output of `d` (a Diagnosis) holds to docs/diagnose.schema.json."""
    import jsonschema
    schema = json.loads((Path(__file__).parent.parent / "docs" / "diagnose.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(d.to_dict())))

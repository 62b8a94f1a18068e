"""The public API (docs/api.md, lab/__init__.py) and the package layering of lab/.

Every name docs/api.md lists imports and is the kind of object it says; `import lab` imports nothing heavy.
The layering: lab's packages, walked with `ast` (module-level imports only: an import inside a function runs
when it is called, after every module has loaded), import none of the layers above their own, and no two
packages import each other, directly or round a longer cycle.
"""
import ast
import inspect
import re
import subprocess
import sys
import types

import pytest

from conftest import REPO
from import_graph import cycles, imports, lab_modules

import lab

# lowest first; a package may import its own layer and those below, never one above
LAYERS = [
    {"core"},
    {"numerics", "scaling", "models", "data", "formats", "fp8"},
    {"run", "study", "rl"},
    {"report", "diagnose", "integrations"},
    {"cli", "commands", "__main__"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


# --- the public API -----------------------------------------------------------------------------------------
def documented_names() -> list[str]:
    """The names docs/api.md's table lists, e.g. `lab.scaling.create`."""
    names = re.findall(r"^\| `(lab\.[\w.]+)", (REPO / "docs" / "api.md").read_text(), flags=re.M)
    assert names, "docs/api.md lists no names"
    return names


def resolve(dotted: str):
    """`lab.a.b` as a user reaches it: attribute by attribute from `import lab`."""
    obj = lab
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


KINDS = {
    "lab.__version__": lambda v: isinstance(v, str) and re.fullmatch(r"\d+\.\d+\.\d+", v),
    "lab.scaling": lambda v: isinstance(v, types.ModuleType),
    "lab.scaling.create": inspect.isfunction,
    "lab.scaling.check": inspect.isfunction,
    "lab.scaling.LossScaler": inspect.isclass,
    "lab.scaling.ScalingPolicy": inspect.isclass,
    "lab.scaling.register": inspect.isfunction,
    "lab.scaling.available": inspect.isfunction,
    "lab.diagnose": lambda v: isinstance(v, types.ModuleType) and callable(v),
    "lab.diagnose.diagnose": inspect.isfunction,
    "lab.diagnose.format_text": inspect.isfunction,
    "lab.diagnose.format_json": inspect.isfunction,
    "lab.diagnose.Diagnosis": inspect.isclass,
    "lab.replay": inspect.isfunction,
    "lab.record": inspect.isfunction,
    "lab.autocast": inspect.isclass,  # a context manager class, as torch.autocast is
    "lab.checkpoint": inspect.isfunction,
    "lab.fp8.create_recipe": inspect.isfunction,
    "lab.fp8.convert": inspect.isfunction,
    "lab.fp8.torchao_autocast_input": inspect.isfunction,
    "lab.integrations.lightning.LabPrecision": inspect.isclass,
    "lab.integrations.lightning.LabFabricPrecision": inspect.isclass,
    "lab.integrations.hf.use_lab_scaler": inspect.isfunction,
    "lab.integrations.hf.use_lab_trainer": inspect.isfunction,
    "lab.integrations.hf.close_recording": inspect.isfunction,
    "lab.models.qat.prepare": inspect.isfunction,
    "lab.models.nf4.quantize_nf4": inspect.isfunction,
    "lab.models.nf4.NF4Linear": inspect.isclass,
    "lab.load_metrics": inspect.isfunction,
    "lab.load_steps": inspect.isfunction,
    "lab.load_census": inspect.isfunction,
}


def test_docs_list_the_public_api():
    assert sorted(documented_names()) == sorted(KINDS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_public_name_is_the_right_kind(name):
    assert KINDS[name](resolve(name)), f"{name} is {resolve(name)!r}"


def test_public_names_are_where_they_live():
    from lab.diagnose import Diagnosis, diagnose, format_json, format_text
    from lab.report import load
    from lab.scaling.engine import LossScaler
    assert (lab.load_metrics, lab.load_steps, lab.load_census) == (load.load_metrics, load.load_steps,
                                                                   load.load_census)
    assert lab.diagnose.diagnose is diagnose and lab.diagnose.Diagnosis is Diagnosis
    assert (lab.diagnose.format_text, lab.diagnose.format_json) == (format_text, format_json)
    assert lab.scaling.LossScaler is LossScaler and isinstance(lab.scaling.create("dynamic"), LossScaler)
    assert "dynamic" in lab.scaling.available()
    from lab.diagnose.replay import replay_run
    assert lab.replay is replay_run
    from lab.run.record import record
    assert lab.record is record
    from lab.numerics.precision import autocast
    assert lab.autocast is autocast
    from lab.numerics.recompute import checkpoint
    assert lab.checkpoint is checkpoint
    from lab.integrations import hf, lightning
    assert lab.integrations.lightning is lightning and lab.integrations.hf.use_lab_trainer is hf.use_lab_trainer
    from lab.fp8.linear import convert
    from lab.fp8.recipe import create_recipe
    assert lab.fp8.convert is convert and lab.fp8.create_recipe is create_recipe
    assert set(lab.__all__) == {"__version__", "scaling", "diagnose", "replay", "record", "autocast",
                                "checkpoint", "load_metrics", "load_steps", "load_census", "integrations", "fp8",
                                "models"}
    from lab.models import nf4, qat
    assert lab.models.qat is qat and lab.models.nf4.quantize_nf4 is nf4.quantize_nf4


def test_the_nf4_example_runs_as_written(capsys):
    """docs/api.md's NF4 base in your own loop, run as written: every linear becomes an NF4Linear dequantizing to
    FP16, the adapters are the only trainable parameters, in FP32, and one FP16 step gives each of them a finite
    gradient."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    text = (REPO / "docs" / "api.md").read_text().split("### An NF4 base in your own loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    scope = {}
    exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102 (the docs' own example)
    import torch
    from lab.models.nf4 import NF4Linear
    model = scope["model"]
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    # both linears stored as 4-bit codes (two to a byte), dequantizing to FP16; no plain linear left but the adapters'
    assert [(m.nf4_quantized_data.numel() * 2, m.nf4_nf4.dtype) for m in layers] == [(64 * 128, torch.float16),
                                                                                     (128 * 10, torch.float16)]
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert plain and all(".lora_A." in n or ".lora_B." in n for n in plain)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable.values())
    assert "'method': 'nf4'" in capsys.readouterr().out


def test_calling_the_diagnose_package_calls_diagnose(tmp_path):
    from lab.diagnose import DiagnoseError
    with pytest.raises(DiagnoseError, match=str(tmp_path / "nope")):
        lab.diagnose(tmp_path / "nope")


def test_version_matches_pyproject():
    assert re.search(rf'^version = "{re.escape(lab.__version__)}"$', (REPO / "pyproject.toml").read_text(), re.M)


def test_import_lab_stays_light():
    code = ("import sys, lab; heavy = sorted(m for m in ('torch', 'pandas', 'numpy', 'matplotlib', 'yaml') "
            "if m in sys.modules); lab_mods = sorted(m for m in sys.modules if m.startswith('lab.')); "
            "print(heavy, lab_mods)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lab.nope  # noqa: B018


# --- the layering -------------------------------------------------------------------------------------------
def package_of(module: str) -> str | None:
    """The top-level package (or cli/__main__) a lab module belongs to; None for the root `lab`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_graph(sources: dict[str, str] | None = None) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """{package: the other packages it imports at module level}, and every (module, package it imports) edge.
    `sources` overrides a module's text (the self-check below plants a forbidden import with it)."""
    sources = sources or {}
    graph: dict[str, set[str]] = {}
    edges = set()
    mods = lab_modules()
    for name, path in mods.items():
        src = sources.get(name, path.read_text())
        targets = imports(ast.parse(src), name, path.name == "__init__.py", mods)
        pkg = package_of(name)
        if pkg is None:  # lab/__init__.py: must stay light, importing nothing at module level
            assert not targets, f"lab/__init__.py imports {sorted(targets)} at module level"
            continue
        for dst in {package_of(t) for t in targets} - {None, pkg}:  # None: `import lab` (imports nothing)
            graph.setdefault(pkg, set()).add(dst)
            edges.add((name, dst))
    return graph, edges


def upward_imports(edges: set[tuple[str, str]]) -> list[str]:
    bad = []
    for module, dst in sorted(edges):
        src = package_of(module)
        assert src in LAYER and dst in LAYER, f"{module} -> lab.{dst}: a package not in LAYERS (give it a layer)"
        if LAYER[dst] > LAYER[src]:
            bad.append(f"{module} imports lab.{dst}, a higher layer")
    return bad


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in lab_modules()} - {None}
    assert packages <= set(LAYER), f"packages without a layer: {sorted(packages - set(LAYER))}"


def test_no_import_cycle_between_packages():
    graph, _ = package_graph()
    assert cycles(graph) == []


def test_no_package_imports_a_higher_layer():
    _, edges = package_graph()
    assert upward_imports(edges) == []


@pytest.mark.parametrize("plants, upward, cycle", [
    ({"lab.numerics.contract": "from lab.cli import main"},                          # numerics imports the CLI
     ["lab.numerics.contract imports lab.cli, a higher layer"], []),
    ({"lab.core.files": "from lab.report.load import load_metrics"},                   # core imports report,
     ["lab.core.files imports lab.report, a higher layer"],                           # which imports core
     [["core", "diagnose", "formats", "models", "numerics", "report", "rl", "run", "scaling", "study"]]),
    # report reads rl's runs; models' gradient checkpointing imports numerics; formats raise core's ConfigError
    ({"lab.run.evaluation": "from lab.study import stats", "lab.study.stats": "from lab.run import evaluation"},
     [], [["run", "study"]]),                                                          # one layer, both ways
    ({"lab.scaling.base": "import lab.models.presets", "lab.models.gpt": "import lab.data.text",
      "lab.data.text": "from lab.scaling import base"}, [], [["data", "models", "scaling"]]),  # round three
])
def test_the_checks_catch_a_forbidden_import(plants, upward, cycle):
    """Imports planted at the end of modules are found: the two tests above would fail on them."""
    mods = lab_modules()
    graph, edges = package_graph({m: mods[m].read_text() + "\n" + line + "\n" for m, line in plants.items()})
    assert upward_imports(edges) == upward
    assert cycles(graph) == cycle

"""Every notebook in notebooks/ runs top to bottom against a small results folder, and is committed clean."""
import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO
from results_fixture import make_results

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_study_overview.ipynb", "02_scale_dynamics.ipynb", "03_census.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs"
            # analysis lives in lab.report (load, derived, figures): notebooks do not read run files themselves
            assert "read_csv" not in cell.source and "json.load" not in cell.source


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """LAB_RESULTS pointing at synthetic results (with a gradient census), and a python3 kernel spec that is
    this interpreter (the venv's), ahead of any other python3 spec on the machine."""
    root = tmp_path_factory.mktemp("nb")
    results = make_results(root / "results")
    spec = root / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (lab venv)", "language": "python"}))
    return {"LAB_RESULTS": str(results), "JUPYTER_PATH": str(root / "jupyter")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_env, monkeypatch):
    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()  # raises on a failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr" and "Warning" in o.text]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"results folder: {kernel_env['LAB_RESULTS']}" in text  # read where LAB_RESULTS says
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, f"{path.name}: figures were not displayed"

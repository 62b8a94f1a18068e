"""Every notebook in notebooks/ runs top to bottom against a small results folder, as the study runs them
(`python -m lab notebooks`: each executed with its outputs, and as HTML), and is committed clean."""
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from conftest import REPO
from lab import cli
from results_fixture import make_controller_tables, make_recipe_runs, make_results

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
def executed(tmp_path_factory):
    """`python -m lab notebooks` once for every notebook (one process, a kernel each: what the workflow's
    notebooks rule runs) on synthetic results with a gradient census; returns (results folder, output folder)."""
    root = tmp_path_factory.mktemp("nb")
    # the default study's synthetic runs and a recipe study's (04_fp8_recipes reads those; the others ignore them)
    results = make_controller_tables(make_recipe_runs(make_results(root / "results")))
    out = root / "out"
    assert cli.main(["notebooks", *map(str, NOTEBOOKS), "--results", str(results), "--out", str(out)]) == 0
    return results, out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_is_written_with_its_outputs_and_as_html(path, executed):
    results, out = executed
    nb = nbformat.read(out / path.name, as_version=4)
    nbformat.validate(nb)
    assert [c.source for c in nb.cells] == [c.source for c in nbformat.read(path, as_version=4).cells]
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr" and "Warning" in o.text]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"results folder: {results.resolve()}" in text  # read where --results says ($LAB_RESULTS)
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    assert shown, f"{path.name}: no table or figure shown"
    images = [o for o in shown if "image/png" in o.data]
    assert len(images) >= 2, f"{path.name}: figures were not displayed"
    # the HTML beside it: every figure embedded, the tables, and nothing fetched (it opens offline)
    html = (out / f"{path.stem}.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(images)
    assert ("<table" in html) == any("text/html" in o.data for o in shown)
    assert nb.cells[0].source.splitlines()[0].lstrip("# ") in html  # the notebook's title
    assert "<script src=" not in html and 'href="http' not in html


def test_a_notebook_that_raises_fails_the_command_naming_it_and_the_cell(tmp_path, capsys):
    """The command fails (exit status 1) naming the notebook, the cell and the error, and writes nothing, not
    even the notebooks that ran: a study never holds a set of notebooks half old and half new."""
    good, bad = tmp_path / "good.ipynb", tmp_path / "planted.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("print('fine')")]), good)
    nbformat.write(new_notebook(cells=[new_markdown_cell("# A planted failure"), new_code_cell("x = 1"),
                                       new_code_cell("raise ValueError(f'planted failure {x}')")]), bad)
    (tmp_path / "results").mkdir()
    out = tmp_path / "out"
    rc = cli.main(["notebooks", str(good), str(bad), "--results", str(tmp_path / "results"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"notebook {bad}, cell 3 (code cell 2) raised ValueError: planted failure 1" in err
    assert "raise ValueError(f'planted failure {x}')" in err  # the cell's source, then its traceback
    assert str(good) not in err
    assert not out.exists()


def test_the_overview_shows_numbers_formatted_for_a_reader():
    """The overview's summary is a Δ with its interval and verdict, top-1 in %, the scale as a power of
    two (lab.report.derived.overview_table), as the README's tables write them, never a raw float like 5.555556e-03;
    the committed notebook shows that table and the runs' (runs_overview), not summary.csv's raw columns."""
    import math
    import re

    import pandas as pd
    from lab.report.derived import overview_table, runs_overview
    summary = pd.read_csv(REPO / "results" / "tables" / "summary.csv")
    table = overview_table(summary)
    cells = table.drop(columns=["model", "mode"]).to_numpy().ravel()
    assert all(isinstance(c, str) for c in cells) and not any(re.search(r"\de-?\d", c) for c in cells)
    by = table.set_index(["model", "mode"])
    row = summary.set_index(["model", "mode"]).loc[("resnet50", "fp16-noscale")]
    assert row["top1_delta"] == pytest.approx(-1 / 180)  # the raw float the notebook used to show: -5.555556e-03
    assert by.loc[("resnet50", "fp16-noscale"), "Δ top-1 (pp)"] == (
        f"{100 * row['top1_delta']:+.2f} ± {100 * row['top1_delta_ci']:.2f} n.r.")
    lm = summary.set_index(["model", "mode"]).loc[("lm", "fp16-noscale")]
    assert by.loc[("lm", "fp16-noscale"), "Δ val loss (nats)"] == f"{lm['val_loss_delta']:+.3f} ± {lm['val_loss_delta_ci']:.3f} cost"
    equiv = summary[summary["val_loss_verdict"] == "equivalent"].iloc[0]  # equivalent: the 90% interval TOST used
    assert by.loc[(equiv["model"], equiv["mode"]), "Δ val loss (nats)"].endswith(f"± {equiv['val_loss_ci90']:.3f} equiv.")
    assert by.loc[("resnet50", "fp32"), "Δ top-1 (pp)"] == "reference"
    assert by.loc[("resnet50", "fp16-static128"), "final scale"] == "2^7"
    # a CPU's 16-bit speed is the emulation's cost, said where shown; FP32 and native paths unmarked
    speed = "speed vs FP32 (this device)"
    assert by.loc[("resnet50", "fp16-static128"), speed].endswith("x (emulated)")
    assert by.loc[("resnet50", "fp32"), speed] == "1.00x"
    native = overview_table(summary.assign(fp16_path="cuda-native")).set_index(["model", "mode"])
    assert native.loc[("resnet50", "fp16-static128"), speed].endswith("x") and "emulated" not in native[speed].sum()
    assert math.isclose(float(by.loc[("resnet50", "fp32"), "top-1 %"].split(" ± ")[0]),
                        100 * summary.set_index(["model", "mode"]).loc[("resnet50", "fp32"), "top1_mean"], abs_tol=0.05)
    runs = runs_overview(pd.DataFrame({"model": ["m"], "mode": ["fp16-dynamic"], "seed": [0], "status": ["ok"],
                                       "final_top1": [0.9736111], "steps": [132.0], "skipped_steps": [1.0],
                                       "overflow_steps": [1.0], "final_scale": [32768.0]}))
    assert runs.iloc[0].tolist() == ["m", "fp16-dynamic", 0, "ok", "97.4", "132", "1", "1", "2^15"]
    assert runs_overview(pd.DataFrame()).empty
    nb = nbformat.read(REPO / "notebooks" / "01_study_overview.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "derived.overview_table(summary)" in code and "derived.runs_overview(metrics)" in code
    assert "top1_delta_vs_fp32" not in code

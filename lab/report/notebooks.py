"""The notebooks, executed against a study's results and rendered as HTML: `python -m lab notebooks`.

notebooks/*.ipynb are committed without outputs. The workflow's `notebooks` rule (workflow/rules/report.smk)
writes each one, executed against the study's results folder, to RESULTS/notebooks/NAME.ipynb (with its
tables and figures) and NAME.html (the same rendered for a browser, figures embedded, nothing fetched).

All notebooks run in one process, each in a kernel of its own started at the same time as the others': a
fresh kernel per notebook is what a person who opens one gets (no variable carried over from another
notebook), and the kernels' start-up and imports overlap instead of adding up. The kernel is this
interpreter, whatever python3 kernel specs the machine holds. A notebook that ran is rendered as HTML while the
others still run. Nothing is written unless every notebook ran: a cell that raises fails the whole command with
the notebook's name, the cell and the error.
"""
from __future__ import annotations

import asyncio
import functools
import os
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.core import files

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 600  # one cell; a full study's figures take seconds, a hung kernel would otherwise hang the study
# lab's HTML template without its <script> tags: require.js, MathJax and Mermaid come from CDNs, and the
# notebooks need none of them (no widgets, math or diagrams); the page then opens offline and can be archived
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # IPython colours its tracebacks; a log file shows them raw


class NotebookError(RuntimeError):
    """One or more notebooks raised: each one's name, cell and error."""


def notebook_paths(folder: str | Path = NOTEBOOKS_DIR) -> list[Path]:
    """The notebooks to execute: folder's *.ipynb, in name order."""
    return sorted(Path(folder).glob("*.ipynb"))


#: the recipe study's notebook, and what a recipe study executes: the FP16 notebooks (scale dynamics, the census of
#: FP16's range) have nothing to show on BF16 runs whose linears are quantized
RECIPES_NOTEBOOK = "04_fp8_recipes"
RECIPE_STUDY_NOTEBOOKS = ("01_study_overview", RECIPES_NOTEBOOK)
#: a study that judges scale rules (a `judge:` block, configs/controllers.yaml) executes this one too
CONTROLLERS_NOTEBOOK = "05_controllers"


def study_notebooks(folder: str | Path = NOTEBOOKS_DIR, recipes: bool = False, controllers: bool = False) -> list[Path]:
    """The notebooks a study executes: a recipe study (a mode with `recipe:`) its overview and the recipes notebook,
    any other study every notebook but the recipes one; the controllers notebook only a study with `judge:`."""
    paths = [p for p in notebook_paths(folder) if controllers or p.stem != CONTROLLERS_NOTEBOOK]
    if recipes:
        return [p for p in paths if p.stem in RECIPE_STUDY_NOTEBOOKS + (CONTROLLERS_NOTEBOOK,)]
    return [p for p in paths if p.stem != RECIPES_NOTEBOOK]


def output_paths(notebooks, out: str | Path) -> list[Path]:
    """What `execute` writes for these notebooks: out/NAME.ipynb and out/NAME.html for each."""
    return [Path(out) / f"{Path(nb).stem}{ext}" for nb in notebooks for ext in (".ipynb", ".html")]


def execute(notebooks, results: str | Path, out: str | Path, timeout: int = CELL_TIMEOUT_S) -> list[Path]:
    """Execute every notebook against `results` (their $LAB_RESULTS) and write it, with its outputs and as
    HTML, under `out`; returns the paths written. Raises NotebookError naming every notebook that failed."""
    import nbformat
    paths = [Path(p) for p in notebooks]
    if not paths:
        raise FileNotFoundError("no notebooks given (expected .ipynb files)")
    names = [p.stem for p in paths]
    if len(set(names)) < len(names):
        raise ValueError(f"notebooks with the same name would write the same output: {', '.join(map(str, paths))}")
    results = Path(results)
    if not results.is_dir():
        raise FileNotFoundError(f"results folder {results}: not found")
    nbs = [nbformat.read(p, as_version=4) for p in paths]
    env = dict(os.environ, LAB_RESULTS=str(results.resolve()))
    outcomes = asyncio.run(_execute_all(paths, nbs, env, timeout))
    failed = [str(error) for error, _ in outcomes if error is not None]
    if failed:
        raise NotebookError("\n\n".join(failed))
    written = []
    for path, nb, (_, html) in zip(paths, nbs, outcomes):
        ipynb_out, html_out = output_paths([path], out)
        files.atomic_write_text(ipynb_out, nbformat.writes(nb) + "\n")
        files.atomic_write_text(html_out, html)
        written += [ipynb_out, html_out]
    return written


async def _execute_all(paths, nbs, env, timeout) -> list[tuple[NotebookError | None, str | None]]:
    # every notebook runs to its end (or its first error) even when another fails: the error names them all.
    # A notebook that ran is rendered as HTML in a thread (nbconvert: 1-2 s for the three, imports included) on
    # the core its kernel no longer uses, while the slowest one still runs: only the last one's HTML is left to
    # wait for. One thread: the one exporter is never used by two at once.
    # The kernels talk over Unix sockets in a folder of their own: TCP ports are picked free and bound only later by
    # the kernel, and with several kernels starting at once (and other processes) one was taken in between ("Address
    # already in use", the notebook failed after a 60 s wait).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbconvert") as html, \
            tempfile.TemporaryDirectory(prefix="lab-kernels-") as sockets:
        return await asyncio.gather(*(_execute_one(p, nb, env, timeout, html, os.path.join(sockets, f"k{i}"))
                                      for i, (p, nb) in enumerate(zip(paths, nbs))))


async def _execute_one(path: Path, nb, env: dict, timeout: int, html,
                       socket_prefix: str) -> tuple[NotebookError | None, str | None]:
    """Run one notebook in a kernel of its own, its cells in place, then render it as HTML in the executor `html`:
    (None, its HTML) when every cell ran, else (the error, None)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    current = {"index": None}

    def started(cell, cell_index):
        current["index"] = cell_index

    client = NotebookClient(
        nb, km=_kernel_manager(socket_prefix), kernel_name="python3", timeout=timeout,
        # a rerun on the same results writes the same files: no timestamps in the cells' metadata, and a cell's
        # prints as one output however the kernel's messages happened to split them
        record_timing=False, coalesce_streams=True,
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working folder, as in Jupyter
        on_cell_execute=started)
    try:
        # cleanup_kc: shut the kernel down afterwards (nbclient leaves a kernel manager it was given running)
        await client.async_execute(env=env, cleanup_kc=True)
    except CellExecutionError as e:
        return _cell_error(path, nb, current["index"], f"{e.ename}: {e.evalue}", str(e)), None
    except Exception as e:  # a cell timed out, the kernel died or did not start: the same report
        return _cell_error(path, nb, current["index"], f"{type(e).__name__}: {e}", ""), None
    return None, await asyncio.get_running_loop().run_in_executor(html, _to_html, path, nb)


def _cell_error(path: Path, nb, index, error: str, detail: str) -> NotebookError:
    if index is None:
        return NotebookError(f"notebook {path}: {error}")
    code_cell = sum(c.cell_type == "code" for c in nb.cells[:index + 1])
    head = f"notebook {path}, cell {index + 1} (code cell {code_cell}) raised {error}"
    return NotebookError(f"{head}\n{_ANSI.sub('', detail).strip()}" if detail else head)


def _kernel_manager(socket_prefix: str):
    """A kernel manager whose python3 kernel is this interpreter (sys.executable), on Unix sockets whose paths start
    with ``socket_prefix`` (an absolute path: the kernel runs in the notebook's folder)."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class ThisInterpreter(KernelSpecManager):
        # another python3 spec (a user's, a conda base's) would run the notebooks with another Python: one
        # that may lack this study's pandas, matplotlib or lab
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3 (ipykernel)", language="python")

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisInterpreter(), transport="ipc",
                              ip=socket_prefix)


def _to_html(path: Path, nb) -> str:
    html, _ = _html_exporter().from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
    return html


@functools.lru_cache(maxsize=None)
def _html_exporter():
    # nbconvert (0.4 s of imports) once, when the first notebook has run: a study whose kernels fail never pays it
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    return HTMLExporter(extra_loaders=[DictLoader({"offline.html.j2": _OFFLINE_TEMPLATE})],
                        template_file="offline.html.j2")

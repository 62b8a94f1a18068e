# Names and input functions for report.smk (kept apart: `snakemake --lint` wants rules and functions in
# separate files). File names come from lab.report.load, so they are known before anything runs.
import os

from lab.core.study import family_modes, family_seeds
from lab.report.load import MODEL_FIGURES, figure_path, mode_figure_path
from lab.report.notebooks import output_paths, study_notebooks

MODELS = list(dict.fromkeys(m for m, _, _ in RUNS))
MODES = list(dict.fromkeys(mode for _, mode, _ in RUNS))
FIGURES_DIR = f"{RESULTS}/figures"
TENSORBOARD_DIR = f"{RESULTS}/tensorboard"
SUMMARY_HTML = f"{RESULTS}/tables/summary.html"
# notebooks/*.ipynb, each executed against RESULTS into NOTEBOOKS_OUT as NAME.ipynb (with outputs) and NAME.html
NOTEBOOK_SOURCES = [os.path.relpath(p) for p in study_notebooks(Path(workflow.basedir) / "notebooks", HAS_RECIPES, bool(JUDGE))]
NOTEBOOKS_OUT = f"{RESULTS}/notebooks"
NOTEBOOK_OUTPUTS = [str(p) for p in output_paths(NOTEBOOK_SOURCES, NOTEBOOKS_OUT)]


def model_figure(name):
    # a per-model figure, grouped in the report by model (category); the cross-mode ones share a subcategory
    return report(
        str(figure_path(FIGURES_DIR, "{model}", name)),
        caption=f"../report/{name}.rst",
        category="{model}",
        subcategory="all modes",
        labels={"model": "{model}", "figure": MODEL_FIGURES[name]},
    )


def mode_figures():
    # one figure per mode (its seeds' scale, loss and gradient norm), in the report under model > mode.
    # (`report(` must not start a line here: the Snakefile parser would read it as the `report:` keyword.)
    marked = [report(
        str(mode_figure_path(FIGURES_DIR, "{model}", mode)),
        caption="../report/mode.rst",
        category="{model}",
        subcategory=mode,
        labels={"model": "{model}", "mode": mode, "figure": "scale, loss and gradient norm per seed"},
    ) for mode in MODES]
    return marked


def model_run_dirs(wildcards):
    return [run_dir(m, mode, s) for m, mode, s in RUNS if m == wildcards.model]


def model_run_files(wildcards):
    # the records of the jobs that trained this model's runs
    return [job_record(m, mode, seeds) for m, mode, seeds in TRAIN_JOBS if m == wildcards.model]


# Vision-language families (models.X.encoder): their first steps measured again with hooks, FP32 and GradScaler's
# defaults (lab/report/first_steps.py)
FIRST_STEPS = {m: [md for md in ("fp32", "fp16-dynamic") if md in family_modes(STUDY, m)]
               for m in STUDY["models"] if encoder_run_of(STUDY, m)}
FIRST_STEPS_OUTPUTS = [f"{FIGURES_DIR}/{m}/first_steps.png" for m, modes in FIRST_STEPS.items() if modes]


REPORT_OUTPUTS = (
    [str(figure_path(FIGURES_DIR, m, name)) for m in MODELS for name in MODEL_FIGURES]
    + [str(mode_figure_path(FIGURES_DIR, m, mode)) for m in MODELS for mode in MODES]
    + [TENSORBOARD_DIR]
    + [SUMMARY_HTML]
    + NOTEBOOK_OUTPUTS
    + FIRST_STEPS_OUTPUTS
)

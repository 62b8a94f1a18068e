# Figures, TensorBoard event files, the summary table as HTML and the notebooks executed (RESULTS/notebooks/):
# `snakemake --report results/report.html` collects the figures and the table (outputs marked report(...),
# captions in workflow/report/) into one self-contained HTML file.


include: "report_common.smk"


rule figures:
    input:
        model_run_files,
    output:
        scale=model_figure("scale"),
        loss=model_figure("loss"),
        grad_hist=model_figure("grad_hist"),
        top1=model_figure("top1"),
        underflow=model_figure("underflow"),
        overflow=model_figure("overflow"),
        modes=mode_figures(),
    params:
        run_dirs=lambda wc: " ".join(model_run_dirs(wc)),
        out=lambda wc, output: str(Path(output.scale).parent.parent),
        modes=" ".join(MODES),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/figures/{{model}}.log",
    wildcard_constraints:
        model=r"[^/]+",
    shell:
        "python -m lab figures --runs {params.run_dirs} --model {wildcards.model} --out {params.out}"
        " --study-modes {params.modes}"
        " > {log} 2>&1"


rule first_steps:
    # a vision-language family's first steps again, stopped after 300: the encoder's feature spread and each
    # branch's gradient range per step, checked step for step against the run's own losses
    input:
        model_run_files,
    output:
        png=report(
            f"{FIGURES_DIR}/{{model}}/first_steps.png",
            caption="../report/first_steps.rst",
            category="{model}",
            subcategory="all modes",
            labels={"model": "{model}", "figure": "vision branch over the first steps"},
        ),
        csv=f"{RESULTS}/tables/first_steps_{{model}}.csv",
    params:
        modes=lambda wc: " ".join(FIRST_STEPS[wc.model]),
        seed=lambda wc: family_seeds(STUDY, wc.model)[0],
        study=STUDY_FILE,
        threads=STUDY["threads"],
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/first_steps/{{model}}.log",
    wildcard_constraints:
        model=r"[^/]+",
    shell:
        "python -m lab first-steps --config {params.study} --model {wildcards.model} --modes {params.modes}"
        " --seed {params.seed} --steps 300 --threads {params.threads} --csv {output.csv} --png {output.png}"
        " > {log} 2>&1"


rule tensorboard:
    # one job for every run: each job would otherwise pay Python's and TensorBoard's start-up again
    input:
        TRAIN_RECORDS,
    output:
        directory(TENSORBOARD_DIR),
    params:
        run_dirs=" ".join(RUN_DIRS),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/tensorboard.log",
    shell:
        "python -m lab tensorboard {params.run_dirs} --out {output} > {log} 2>&1"


rule summary_html:
    input:
        SUMMARY_CSV,
    output:
        report(
            SUMMARY_HTML,
            caption="../report/summary.rst",
            category="Summary",
            labels={"table": "every model x mode"},
        ),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/summary_html.log",
    shell:
        "python -m lab summary-html {input} --out {output} > {log} 2>&1"


rule notebooks:
    # every notebook in one job: one process runs them all at once, a kernel each (lab/report/notebooks.py).
    # Inputs: what they read (the summary table, the runs through their jobs' records) and the notebooks.
    input:
        notebooks=NOTEBOOK_SOURCES,
        summary=SUMMARY_CSV,
        runs=TRAIN_RECORDS,
    output:
        NOTEBOOK_OUTPUTS,
    params:
        # their $LAB_RESULTS: this study's results folder (RESULTS/tables/summary.csv), wherever the config puts it
        results=lambda wc, input: str(Path(input.summary).parent.parent),
        out=lambda wc, output: str(Path(output[0]).parent),
    threads: max(1, len(NOTEBOOK_SOURCES))  # a busy kernel per notebook
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/notebooks.log",
    shell:
        "python -m lab notebooks {input.notebooks:q} --results {params.results:q} --out {params.out:q} > {log} 2>&1"

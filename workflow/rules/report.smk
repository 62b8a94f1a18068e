# Figures, TensorBoard event files and the summary table as HTML: `snakemake --report results/report.html`
# collects the figures and the table (outputs marked report(...), captions in workflow/report/) into one
# self-contained HTML file.


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

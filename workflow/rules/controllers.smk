# Scale models learned from the study's own runs (the config's `controllers:`; lab/scaling/learning, docs/
# controllers.md): each fitted by `lab fit-controller` from the runs it names into RESULTS/models/NAME.json (the runs
# it learned from listed inside), before the runs whose mode uses it; then every rule replayed on the held-out runs
# (`judge:`) by `lab judge-controllers`: tables and the Pareto figures.
# the Pareto figures: one per judged family (lab/scaling/learning/tables.py `figures`)
CONTROLLER_FIGURES = [f"{RESULTS}/figures/controllers_{kind}_{family}.png"
                      for kind in ("fp16", "fp8") for family in JUDGE.get(kind, {})]
CONTROLLER_TABLES = (
    [f"{RESULTS}/tables/controllers_fp16.csv", f"{RESULTS}/tables/controllers_fp16.md",
     f"{RESULTS}/tables/controllers_fp8.csv", *CONTROLLER_FIGURES]
    if JUDGE
    else []
)


rule fit_controller:
    input:
        lambda wc: learn_records(wc.name),
    output:
        f"{MODELS_DIR}/{{name}}.json",
    params:
        runs=lambda wc: " ".join(learn_dirs(wc.name)),
        settings=lambda wc: " ".join(
            f"--{k} {CONTROLLERS[wc.name].get(k, d)}"
            for k, d in (("controller", "learned"), ("history", "fp16"), ("quantile", 0.99),
                         ("iterations", 150), ("seed", 0))
        ),
    wildcard_constraints:
        name=r"[A-Za-z0-9_.+-]+",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/fit_controller/{{name}}.log",
    shell:
        "python -m lab fit-controller {params.runs} {params.settings} --out {output} > {log} 2>&1"


rule judge_controllers:
    input:
        records=TRAIN_RECORDS,
        models=list(CONTROLLER_FILES),
    output:
        fp16=f"{RESULTS}/tables/controllers_fp16.csv",
        fp16_md=f"{RESULTS}/tables/controllers_fp16.md",
        fp8=f"{RESULTS}/tables/controllers_fp8.csv",
        figures=report(CONTROLLER_FIGURES, category="Scales that predict",
                       caption="../report/controllers.rst"),
    params:
        fp16=" ".join(judged_dirs("fp16")),
        fp8=" ".join(judged_dirs("fp8")),
        out=lambda wc, output: str(Path(output.fp16).parent),
        figures=f"{RESULTS}/figures",
        models=MODELS_DIR,
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/judge_controllers.log",
    shell:
        "python -m lab judge-controllers --fp16 {params.fp16} --fp8 {params.fp8} --models {params.models}"
        " --out {params.out} --figures {params.figures} > {log} 2>&1"

# Scale models learned from the study's own runs (the config's `controllers:`; lab/scaling/learning, docs/
# controllers.md): each fitted by `lab fit-controller` from the runs it names into RESULTS/models/NAME.json (the runs
# it learned from listed inside), before the runs whose mode uses it; then every rule replayed on the held-out runs
# (`judge:`) by `lab judge-controllers`: tables and the Pareto figures.
CONTROLLERS = STUDY.get("controllers", {})
MODELS_DIR = f"{RESULTS}/models"
CONTROLLER_FILES = {f"{MODELS_DIR}/{name}.json": name for name in CONTROLLERS}
JUDGE = STUDY.get("judge", {})
CONTROLLER_TABLES = (
    [f"{RESULTS}/tables/controllers_fp16.csv", f"{RESULTS}/tables/controllers_fp16.md",
     f"{RESULTS}/tables/controllers_fp8.csv", f"{RESULTS}/figures/controllers.done"]
    if JUDGE
    else []
)


def learn_records(name):
    want = CONTROLLERS[name]["learn_from"]
    return [job_record(m, mode, seeds) for m, mode, seeds in TRAIN_JOBS if mode in want.get(m, [])]


def learn_dirs(name):
    want = CONTROLLERS[name]["learn_from"]
    return [run_dir(m, mode, s) for m, mode, s in RUNS if mode in want.get(m, [])]


def judged_dirs(kind):
    want = JUDGE.get(kind, {})
    return [run_dir(m, mode, s) for m, mode, s in RUNS if mode in want.get(m, [])]


def scale_models(wildcards):
    # a mode that names a fitted model (a predictor's or the controller's `model:`) trains after its fit
    text = str(STUDY["modes"][wildcards.mode])
    return [path for path in CONTROLLER_FILES if path in text]


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
        figures=touch(f"{RESULTS}/figures/controllers.done"),
    params:
        fp16=" ".join(judged_dirs("fp16")),
        fp8=" ".join(judged_dirs("fp8")),
        out=f"{RESULTS}/tables",
        figures=f"{RESULTS}/figures",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/judge_controllers.log",
    shell:
        "python -m lab judge-controllers --fp16 {params.fp16} --fp8 {params.fp8} --models " + MODELS_DIR +
        " --out {params.out} --figures {params.figures} > {log} 2>&1"

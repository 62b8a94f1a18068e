# processes_per_run > 1: the run goes under torchrun with DistributedDataParallel (docs/distributed.md), on as
# many GPUs (the gpu resource) and with `threads` torch threads per process.
PROCESSES = STUDY["processes_per_run"]
LAUNCHER = "python" if PROCESSES == 1 else f"torchrun --standalone --nproc-per-node {PROCESSES}"


rule train:
    input:
        user_policy_file,
        base_model_record,
        scale_models,
    output:
        f"{RESULTS}/runs/{{model}}/{{mode}}/seeds{{seeds}}.json",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/train/{{model}}/{{mode}}/seeds{{seeds}}.log",
    params:
        expect_hashes=expect_hash_args,
        seeds=lambda wc: " ".join(f"--seed {s}" for s in job_seeds(wc)),
        out=lambda wc: f"{RESULTS}/runs/{wc.model}/{wc.mode}/seed{{seed}}",  # lab train fills in {seed}
        study=STUDY_FILE,
        launcher=LAUNCHER,
        threads_per_process=STUDY["threads"],
    threads: STUDY["threads"] * PROCESSES
    resources:
        gpu=lambda wc: uses_gpu(wc) * PROCESSES,
    wildcard_constraints:
        model=r"[^/]+",
        mode=r"[^/]+",
        seeds=r"\d+(-\d+)*",
    # The runs' progress goes to the terminal and to {log}, which Snakemake empties before every attempt; each
    # run folder's train.log (--run-log: not an output, so never deleted) keeps every attempt's lines: the one
    # killed, the one that resumed it. (Snakemake's bash runs with pipefail: tee keeps lab train's exit status.)
    shell:
        "{params.launcher} -m lab train --model {wildcards.model} --mode {wildcards.mode} {params.seeds}"
        " --out '{params.out}' --config '{params.study}' --threads {params.threads_per_process} {params.expect_hashes}"
        " --recover-finished --run-log --done {output} 2>&1 | tee {log}"

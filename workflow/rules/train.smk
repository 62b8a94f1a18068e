# processes_per_run > 1: the run goes under torchrun with DistributedDataParallel (docs/distributed.md), on as
# many GPUs (the gpu resource) and with `threads` torch threads per process.
PROCESSES = STUDY["processes_per_run"]
LAUNCHER = "python" if PROCESSES == 1 else f"torchrun --standalone --nproc-per-node {PROCESSES}"


rule train:
    input:
        user_policy_file,
    output:
        metrics=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/metrics.json",
        steps=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/steps.csv",
        config=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/config.yaml",
        provenance=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/provenance.json",
        census=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/census.csv",
        grad_hist=f"{RESULTS}/runs/{{model}}/{{mode}}/seed{{seed}}/grad_hist.csv",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/train/{{model}}/{{mode}}/seed{{seed}}.log",
    params:
        run_hash=run_hash,
        configs=config_args,
        run_dir=lambda wc, output: str(Path(output.metrics).parent),
        launcher=LAUNCHER,
        threads_per_process=STUDY["threads"],
    threads: STUDY["threads"] * PROCESSES
    resources:
        gpu=lambda wc: uses_gpu(wc) * PROCESSES,
    wildcard_constraints:
        seed=r"\d+",
    # Snakemake empties {log} before every attempt; the run directory's train.log (not an output, so never
    # deleted) keeps every attempt's lines: the one killed, the one that resumed it.
    shell:
        "mkdir -p {params.run_dir} && {params.launcher} -m lab train --model {wildcards.model}"
        " --mode {wildcards.mode} --seed {wildcards.seed}"
        " --out {params.run_dir} {params.configs} --threads {params.threads_per_process}"
        " --expect-hash {params.run_hash} --recover-finished"
        " 2>&1 | tee -a {log} {params.run_dir}/train.log"

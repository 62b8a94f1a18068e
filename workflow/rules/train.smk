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
    threads: STUDY["threads"]
    resources:
        gpu=uses_gpu,
    wildcard_constraints:
        seed=r"\d+",
    shell:
        "python -m lab train --model {wildcards.model} --mode {wildcards.mode} --seed {wildcards.seed}"
        " --out {params.run_dir} {params.configs} --threads {threads} --expect-hash {params.run_hash}"
        " 2>&1 | tee {log}"

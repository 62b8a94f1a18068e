# The RL study's DPO family (configs/rl.yaml's `dpo:` block, docs/rl.md): one FP32 base on pydoc's pretrain half,
# every (mode, seed) DPO run from it, then the table. Thin rules calling `python -m lab ...`; the Snakefile includes
# this file after workflow/rules/rl.smk (RL, RL_RESULTS, RL_CONFIG) when the config has a `dpo:` block.
from lab.rl.dpo_study import dpo_runs

DPO = RL["dpo"]
DPO_RESULTS = f"{RL_RESULTS}/dpo"
DPO_BASE = f"{DPO_RESULTS}/base.pt"
DPO_METRICS = [f"{DPO_RESULTS}/runs/{mode}/seed{seed}/metrics.json" for mode, seed in dpo_runs(DPO)]
DPO_TARGETS = [f"{RL_RESULTS}/tables/dpo_summary.csv", f"{RL_RESULTS}/tables/dpo_summary.md", RL_DPO_RUNS_CSV,
               *DPO_METRICS]  # `all`


rule rl_dpo_base:
    output:
        DPO_BASE,
    params:
        steps=DPO["base"]["steps"],
        seed=DPO["base"]["seed"],
    threads: 1
    conda:
        "../envs/lab.yaml"
    log:
        f"{DPO_RESULTS}/logs/base.log",
    shell:
        "OMP_NUM_THREADS=1 python -m lab rl-dpo-base --out {output} --steps {params.steps} --seed {params.seed}"
        " > {log} 2>&1"


rule rl_dpo_train:
    input:
        base=DPO_BASE,
    output:
        f"{DPO_RESULTS}/runs/{{mode}}/seed{{seed}}/metrics.json",
    params:
        out=lambda wc: f"{DPO_RESULTS}/runs/{wc.mode}/seed{wc.seed}",
        config=RL_CONFIG,
        settings=lambda wc: repr((DPO["modes"][wc.mode], sorted(DPO["train"].items()))),  # edits elsewhere: no rerun
    wildcard_constraints:
        seed=r"\d+",
    threads: 1
    conda:
        "../envs/lab.yaml"
    log:
        f"{DPO_RESULTS}/logs/train/{{mode}}/seed{{seed}}.log",
    shell:
        # a run interrupted before its metrics.json leaves a recording without one: started again from the base
        "rm -rf {params.out} && OMP_NUM_THREADS=1 python -m lab rl-dpo-train --config {params.config}"
        " --mode {wildcards.mode} --seed {wildcards.seed} --base {input.base} --out {params.out} > {log} 2>&1"


rule rl_dpo_aggregate:
    input:
        DPO_METRICS,
        config=RL_CONFIG,
    output:
        csv=DPO_TARGETS[0],
        md=DPO_TARGETS[1],
        runs=RL_DPO_RUNS_CSV,
    conda:
        "../envs/lab.yaml"
    log:
        f"{DPO_RESULTS}/logs/aggregate.log",
    shell:
        "python -m lab rl-dpo-aggregate --config {input.config} --csv {output.csv} --md {output.md} --runs {output.runs}"
        " > {log} 2>&1"

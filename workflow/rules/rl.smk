# The RL study (configs/rl.yaml, docs/rl.md): one base policy, then every (mode, seed) GRPO run from it, then the
# table. Thin rules: each calls `python -m lab ...`; the Snakefile includes this file instead of the main study's
# rules when the config says `study: rl`.
import os
import sys

sys.path.insert(0, workflow.basedir)  # `import lab` from the repository root

from lab.core.errors import ConfigError
from lab.rl.grpo_study import mode_settings, rl_runs
from lab.rl.study import load_rl_study

try:
    RL = load_rl_study(config)
except ConfigError as err:
    raise WorkflowError(str(err))

RL_RESULTS = RL["results_dir"]
RL_CONFIG = workflow.overwrite_configfiles[0] if workflow.overwrite_configfiles else "configs/rl.yaml"
RL_BASE = f"{RL_RESULTS}/base.pt"
RL_METRICS = [f"{RL_RESULTS}/runs/{mode}/seed{seed}/metrics.json" for mode, seed in rl_runs(RL)]
RL_FIGURES = [f"{RL_RESULTS}/figures/{name}" for name in ("reward.png", "mismatch_hist.png", "scale.png")]
RL_RUNS_CSV = f"{RL_RESULTS}/tables/runs.csv"
RL_SHAPE_CSV = f"{RL_RESULTS}/tables/shape.csv"
RL_CLAIMS_MD = f"{RL_RESULTS}/tables/claims.md"
RL_DPO_RUNS_CSV = f"{RL_RESULTS}/tables/dpo_runs.csv" if RL["dpo"] else None  # the DPO family's runs (rl_dpo.smk)
RL_SHAPE_KEPT = f"{RL_RESULTS}/runs/shape/shape.csv"  # beside the runs (not committed): a fresh clone measures again
# `all`: the runs too, so that a fresh clone, which has the committed tables but not the runs, trains them and
# remakes every table from them instead of calling the committed ones up to date
RL_TARGETS = [f"{RL_RESULTS}/tables/summary.csv", f"{RL_RESULTS}/tables/summary.md", *RL_FIGURES, *RL_METRICS,
              RL_SHAPE_KEPT]
if RL["claims"]:
    RL_TARGETS.append(RL_CLAIMS_MD)



rule rl_base:
    output:
        RL_BASE,
    params:
        steps=RL["base"]["steps"],
        seed=RL["base"]["seed"],
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/base.log",
    shell:
        "python -m lab rl-base --out {output} --steps {params.steps} --seed {params.seed} > {log} 2>&1"


rule rl_train:
    input:
        base=RL_BASE,
    output:
        f"{RL_RESULTS}/runs/{{mode}}/seed{{seed}}/metrics.json",
    params:
        out=lambda wc: f"{RL_RESULTS}/runs/{wc.mode}/seed{wc.seed}",
        config=RL_CONFIG,
        settings=lambda wc: mode_settings(RL, wc.mode),  # an edit of another mode reruns nothing
    wildcard_constraints:
        seed=r"\d+",
    threads: 1
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/train/{{mode}}/seed{{seed}}.log",
    shell:
        # a run interrupted before its metrics.json leaves a recording without one: started again from the base
        "rm -rf {params.out} && OMP_NUM_THREADS=1 python -m lab rl-train --config {params.config} --mode {wildcards.mode}"
        " --seed {wildcards.seed} --base {input.base} --out {params.out} > {log} 2>&1"


rule rl_aggregate:
    input:
        RL_METRICS,
        config=RL_CONFIG,
    output:
        csv=f"{RL_RESULTS}/tables/summary.csv",
        md=f"{RL_RESULTS}/tables/summary.md",
        runs=RL_RUNS_CSV,
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/aggregate.log",
    shell:
        "python -m lab rl-aggregate --config {input.config} --csv {output.csv} --md {output.md} --runs {output.runs}"
        " > {log} 2>&1"


rule rl_figures:
    input:
        RL_METRICS,
        config=RL_CONFIG,
    output:
        RL_FIGURES,
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/figures.log",
    shell:
        "python -m lab rl-figures --config {input.config} --out {params.out} > {log} 2>&1"


rule rl_shape:
    output:
        table=RL_SHAPE_CSV,
        kept=RL_SHAPE_KEPT,
    params:
        seeds=" ".join(str(s) for s in (RL["shape"] or {"seeds": [0]})["seeds"]),
    threads: 1
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/shape.log",
    shell:
        "OMP_NUM_THREADS=1 python -m lab rl-shape --seeds {params.seeds} --csv {output.kept} > {log} 2>&1"
        " && cp {output.kept} {output.table}"


rule rl_claims:
    input:
        runs=RL_RUNS_CSV,
        shape=RL_SHAPE_CSV,
        claims=RL["claims"] or [],
        dpo=RL_DPO_RUNS_CSV or [],  # the DPO family's runs join the runs table (configs/claims_rl_long.yaml)
    params:
        dpo=f" --dpo-runs {RL_DPO_RUNS_CSV}" if RL_DPO_RUNS_CSV else "",
    output:
        RL_CLAIMS_MD,
    conda:
        "../envs/lab.yaml"
    log:
        f"{RL_RESULTS}/logs/claims.log",
    shell:
        "python -m lab rl-claims --claims {input.claims} --runs {input.runs} --shape {input.shape}{params.dpo} --md {output}"
        " > {log} 2>&1"

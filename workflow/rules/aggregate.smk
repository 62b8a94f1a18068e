rule aggregate:
    input:
        records=TRAIN_RECORDS,
        claims=CLAIMS_YAML,  # its `declared:` margins and effects of interest
    output:
        csv=SUMMARY_CSV,
        md=SUMMARY_MD,
        runs=RUNS_CSV,  # one row per run: what per-run claims read (lab/study/runs_table.py)
    params:
        run_dirs=" ".join(RUN_DIRS),
        # the study's `stats:` block (margins fixed before the runs); a change re-runs only this rule
        stats=" ".join([f"--confidence {STUDY['stats']['confidence']}"]
                       + [f"--margin {k}={v}" for k, v in STUDY["stats"]["margins"].items()]),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/aggregate.log",
    shell:
        "python -m lab aggregate {params.run_dirs} --csv {output.csv} --md {output.md} {params.stats}"
        " --declared {input.claims} --runs-csv {output.runs}"
        " > {log} 2>&1"


# The config's `compare:` pairs, side by side and paired by seed (lab/study/compare.py).
COMPARE_TABLES = [f"{RESULTS}/tables/compare_{a}_vs_{b}.md" for a, b in STUDY.get("compare", [])]


rule compare:
    input:
        TRAIN_RECORDS,
    output:
        md=f"{RESULTS}/tables/compare_{{left}}_vs_{{right}}.md",
        csv=f"{RESULTS}/tables/compare_{{left}}_vs_{{right}}.csv",
    params:
        run_dirs=" ".join(RUN_DIRS),
    wildcard_constraints:
        left=r"[^/]+?",
        right=r"[^/]+",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/compare_{{left}}_vs_{{right}}.log",
    shell:
        "python -m lab compare {params.run_dirs} --left {wildcards.left} --right {wildcards.right}"
        " --md {output.md} --csv {output.csv} > {log} 2>&1"

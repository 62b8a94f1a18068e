# The source study's claims (configs/claims.yaml) checked against the summary table: supported /
# contradicted / not resolved / out of reach, with the intervals that decide each. The claims file is an
# input, so editing a claim re-runs only this rule. `python -m lab claims --readme README.md` also refreshes the README.


rule claims:
    input:
        summary=SUMMARY_CSV,
        claims=CLAIMS_YAML,
        # the per-run table: a claim's `reads: runs` (configs/claims.yaml), or a whole file's (configs/claims_fp8.yaml)
        runs=RUNS_CSV,
    output:
        report(
            CLAIMS_MD,
            caption="../report/claims.rst",
            category="Claims",
            labels={"table": "source study's claims, checked"},
        ),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/claims.log",
    shell:
        "python -m lab claims --summary {input.summary} --claims {input.claims} --md {output}"
        " --runs {input.runs} > {log} 2>&1"

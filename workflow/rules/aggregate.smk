rule aggregate:
    input:
        [f"{RESULTS}/runs/{m}/{mode}/seed{s}/metrics.json" for m, mode, s in RUNS],
    output:
        csv=SUMMARY_CSV,
        md=SUMMARY_MD,
    params:
        run_dirs=lambda wc, input: " ".join(str(Path(f).parent) for f in input),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/aggregate.log",
    shell:
        "python -m lab aggregate {params.run_dirs} --csv {output.csv} --md {output.md} > {log} 2>&1"

rule aggregate:
    input:
        [f"{RESULTS}/runs/{m}/{mode}/seed{s}/metrics.json" for m, mode, s in RUNS],
    output:
        csv=SUMMARY_CSV,
        md=SUMMARY_MD,
    params:
        run_dirs=lambda wc, input: " ".join(str(Path(f).parent) for f in input),
        # the study's `stats:` block (margins fixed before the runs); a change re-runs only this rule
        stats=" ".join([f"--confidence {STUDY['stats']['confidence']}"]
                       + [f"--margin {k}={v}" for k, v in STUDY["stats"]["margins"].items()]),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/aggregate.log",
    shell:
        "python -m lab aggregate {params.run_dirs} --csv {output.csv} --md {output.md} {params.stats}"
        " > {log} 2>&1"

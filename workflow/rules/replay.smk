# Every FP16 policy of the study replayed on every run (lab/diagnose/replay.py), and the check of replay against
# the real runs: each policy replayed on the FP32 run of a family and seed against its own run there
# (lab/report/replay_table.py; docs/replay.md).
REPLAY_CSV = f"{RESULTS}/tables/replay.csv"
REPLAY_AGREEMENT_CSV = f"{RESULTS}/tables/replay_agreement.csv"
REPLAY_AGREEMENT_MD = f"{RESULTS}/tables/replay_agreement.md"


rule replay:
    input:
        TRAIN_RECORDS,
    output:
        csv=REPLAY_CSV,
        agreement_csv=REPLAY_AGREEMENT_CSV,
        agreement_md=report(REPLAY_AGREEMENT_MD, category="Tables", caption="../report/replay.rst"),
    params:
        run_dirs=" ".join(RUN_DIRS),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/replay.log",
    shell:
        "python -m lab replay-table {params.run_dirs} --csv {output.csv} --agreement-csv {output.agreement_csv}"
        " --agreement-md {output.agreement_md} > {log} 2>&1"

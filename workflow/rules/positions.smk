# A study whose runs record their gradients by position (train.position_probe; configs/long-context.yaml): every
# run's positions.csv gathered by context and mode, its table and figure (lab/report/positions_table.py).
POSITIONS_CSV = f"{RESULTS}/tables/positions.csv"
POSITIONS_MD = f"{RESULTS}/tables/positions.md"
POSITIONS_FIGURE = f"{RESULTS}/figures/positions.png"
POSITION_TABLES = [POSITIONS_CSV, POSITIONS_MD, POSITIONS_FIGURE] if HAS_POSITIONS else []


rule positions_table:
    input:
        TRAIN_RECORDS,
    output:
        csv=POSITIONS_CSV,
        md=POSITIONS_MD,
        figure=POSITIONS_FIGURE,
    params:
        run_dirs=" ".join(RUN_DIRS),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/positions_table.log",
    shell:
        "python -m lab positions-table {params.run_dirs} --csv {output.csv} --md {output.md}"
        " --figure {output.figure} > {log} 2>&1"

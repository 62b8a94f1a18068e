# The FP8/FP4 recipe study's tables (configs/fp8.yaml): one row per run (runs.csv, what configs/claims_fp8.yaml
# decides on) and one per (model, mode): loss against BF16 and FP32, saturated and flushed shares per tensor kind;
# and its figure. Only a study with a mode that names a recipe (HAS_RECIPES, workflow/rules/common.smk) has them.
RECIPE_RUNS_CSV = f"{RESULTS}/tables/runs.csv"
RECIPE_FIGURE = f"{RESULTS}/figures/recipes.png"
RECIPE_TABLES = (
    [RECIPE_RUNS_CSV, f"{RESULTS}/tables/recipes.csv", f"{RESULTS}/tables/recipes.md", RECIPE_FIGURE]
    if HAS_RECIPES
    else []
)


rule recipes_tables:
    input:
        TRAIN_RECORDS,
    output:
        runs=RECIPE_RUNS_CSV,
        csv=f"{RESULTS}/tables/recipes.csv",
        md=f"{RESULTS}/tables/recipes.md",
        figure=RECIPE_FIGURE,
    params:
        run_dirs=" ".join(RUN_DIRS),
        out=lambda wc, output: str(Path(output.runs).parent),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/recipes_tables.log",
    shell:
        "python -m lab recipes-tables {params.run_dirs} --out {params.out} --figure {output.figure} > {log} 2>&1"

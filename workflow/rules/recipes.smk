# The FP8/FP4 recipe study's tables (configs/fp8.yaml), from the study's per-run table (runs.csv: `lab aggregate`
# writes it for every study, workflow/rules/aggregate.smk; what configs/claims_fp8.yaml decides on): one row per
# (model, mode), loss against BF16 and FP32, saturated and flushed shares per tensor kind; and its figure. Only a study
# with a mode that names a recipe (HAS_RECIPES, workflow/rules/common.smk) has them.
RECIPE_RUNS_CSV = RUNS_CSV
RECIPE_FIGURE = f"{RESULTS}/figures/recipes.png"
RECIPE_TABLES = (
    [RECIPE_RUNS_CSV, f"{RESULTS}/tables/recipes.csv", f"{RESULTS}/tables/recipes.md", RECIPE_FIGURE]
    if HAS_RECIPES
    else []
)


rule recipes_tables:
    input:
        runs=RECIPE_RUNS_CSV,
    output:
        csv=f"{RESULTS}/tables/recipes.csv",
        md=f"{RESULTS}/tables/recipes.md",
        figure=RECIPE_FIGURE,
    params:
        out=lambda wc, output: str(Path(output.csv).parent),
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/recipes_tables.log",
    shell:
        "python -m lab recipes-tables {input.runs} --out {params.out} --figure {output.figure} > {log} 2>&1"

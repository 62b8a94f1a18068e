# The FP8/FP4 recipe study's tables (configs/fp8.yaml): one row per run (runs.csv, what configs/claims_fp8.yaml
# decides on) and one per (model, mode): loss against BF16 and FP32, saturated and flushed shares per tensor kind.
# Only a study with a mode that names a recipe has them.
HAS_RECIPES = any(m.get("recipe") for m in STUDY["modes"].values())
RECIPE_RUNS_CSV = f"{RESULTS}/tables/runs.csv"
RECIPE_TABLES = [RECIPE_RUNS_CSV, f"{RESULTS}/tables/recipes.csv", f"{RESULTS}/tables/recipes.md"] if HAS_RECIPES else []


rule recipes_tables:
    input:
        TRAIN_RECORDS,
    output:
        RECIPE_RUNS_CSV,
        f"{RESULTS}/tables/recipes.csv",
        f"{RESULTS}/tables/recipes.md",
    params:
        run_dirs=" ".join(RUN_DIRS),
        out=f"{RESULTS}/tables",
    conda:
        "../envs/lab.yaml"
    log:
        f"{RESULTS}/logs/recipes_tables.log",
    shell:
        "python -m lab recipes-tables {params.run_dirs} --out {params.out} > {log} 2>&1"

"""`python -m lab recipes-tables`: the FP8/FP4 recipe study's tables (runs.csv, recipes.csv, recipes.md) and its
figure (lab/report/recipes_table.py, lab/report/recipe_figures.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    r = sub.add_parser("recipes-tables", help="the FP8/FP4 recipe study's tables: runs.csv, recipes.csv, recipes.md "
                                              "(lab/report/recipes_table.py)")
    r.add_argument("runs", nargs="+", help="results folder(s), runs/ folders or run directories (runs.csv written "
                   "too), or the study's runs.csv (`lab aggregate --runs-csv`; the workflow's)")
    r.add_argument("--out", required=True, help="folder for runs.csv, recipes.csv and recipes.md")
    r.add_argument("--figure", default=None, help="also draw the study's figure (PNG) there")
    r.set_defaults(handler=main)


def main(args) -> int:
    from lab.report.recipes_table import write
    runs, table = write(args.runs, args.out)
    print(f"{len(runs)} runs, {len(table)} (model, mode) rows -> {args.out}/recipes.md")
    if args.figure and len(table):
        from lab.report.recipe_figures import recipes_figure
        print(f"figure -> {recipes_figure(table, args.figure)}")
    return 0

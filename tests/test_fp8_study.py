"""FP8/FP4 recipes in the DAG: docs/fp8.md's "Add a recipe" done exactly as written trains in a tiny study, with its
tables; a recipe mode's errors are the config's errors."""
import re
import sys

import pandas as pd
import pytest
import yaml

from conftest import REPO, tiny_study
from test_workflow import snakemake

from lab.core.config import ConfigError, validate_study


def doc_blocks():
    section = (REPO / "docs" / "fp8.md").read_text().split("## Add a recipe", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_a_new_recipe_in_one_file_and_one_line_trains_in_the_dag(repo_copy):
    code = next(c for lang, c in doc_blocks() if lang == "python")
    line = next(c for lang, c in doc_blocks() if lang == "yaml")
    target = code.splitlines()[0].lstrip("# ").strip()
    assert target.startswith("lab/fp8/recipes/")
    (repo_copy / target).write_text(code)
    study = tiny_study(models={"vit": {"preset": "vit-tiny-digits"}},
                       modes={"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}})
    study["train"]["census_every"] = 1
    config = repo_copy / "configs" / "default.yaml"
    config.write_text(yaml.safe_dump(study, sort_keys=False) + line)
    # the recipe tables alone (the runs they read, nothing of the report): the DAG trains the new mode for them
    res = snakemake(repo_copy, "--cores", "2", "results/tables/recipes.md")
    assert res.returncode == 0, res.stderr[-3000:]
    (mode,) = yaml.safe_load(line)
    runs = pd.read_csv(repo_copy / "results" / "tables" / "runs.csv")
    row = runs[runs["mode"] == mode].iloc[0]
    assert row["recipe"] == mode and row["diverged"] == 0
    assert 0 <= row["flushed_gradient_pct"] <= 100  # its census ran: the recipe's layers counted what they lost
    assert mode in (repo_copy / "results" / "tables" / "recipes.md").read_text()


@pytest.mark.parametrize("mode,words", [
    ({"precision": "bf16", "recipe": "fp8-curent"}, "did you mean 'fp8-current'"),
    ({"precision": "fp16", "recipe": "fp8-current"}, "expected precision bf16"),
    ({"precision": "bf16", "recipe": {"name": "mxfp8", "rounding": "up"}}, "rounding must be one of"),
    ({"precision": "bf16", "recipe": {"name": "nvfp4", "hadamard": True}}, "unknown setting 'hadamard'"),
    ({"precision": "bf16", "recipe": {"name": "fp8-current", "accumulate": "fp16"}}, "accumulate must be"),
])
def test_bad_recipes_are_refused_with_the_configs_errors(mode, words):
    study = tiny_study(modes={"fp32": {"precision": "fp32"}, "bad": mode})
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate_study(study)

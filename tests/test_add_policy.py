"""README "Add a scaling policy", done exactly as written, in a temporary copy of the repository."""
import re

import pandas as pd
import yaml

from conftest import REPO, tiny_study
from test_workflow import snakemake


def readme_blocks():
    text = (REPO / "README.md").read_text()
    section = text.split("## Add a scaling policy", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_add_policy_as_the_readme_says(repo_copy):
    blocks = readme_blocks()
    policy_code = next(code for lang, code in blocks if lang == "python")
    mode_line = next(code for lang, code in blocks if lang == "yaml")
    target = policy_code.splitlines()[0].lstrip("# ").strip()
    assert target.startswith("lab/policies/")

    # a small study standing in for configs/default.yaml (one family: what holds for one holds for each), modes
    # last as in the shipped file
    study = tiny_study(models={"resnet50": {"preset": "resnet50-digits"}})
    config = repo_copy / "configs" / "default.yaml"
    config.write_text(yaml.safe_dump(study, sort_keys=False))
    assert list(yaml.safe_load(config.read_text()))[-1] == "modes"
    first = snakemake(repo_copy, "--cores", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.stat().st_mtime_ns for p in (repo_copy / "results" / "runs").rglob("metrics.json")}

    # the README's two steps: the policy file, and one mode line in the config
    (repo_copy / target).write_text(policy_code)
    with open(config, "a") as f:
        f.write(mode_line)
    new_mode = yaml.safe_load(mode_line)
    (mode_name,) = new_mode
    second = snakemake(repo_copy, "--cores", "2")
    assert second.returncode == 0, second.stderr[-3000:]

    after = {p: p.stat().st_mtime_ns for p in (repo_copy / "results" / "runs").rglob("metrics.json")}
    assert all(after[p] == t for p, t in before.items()), "existing runs must not be re-trained"
    new_runs = sorted(p.parent.relative_to(repo_copy / "results" / "runs").as_posix() for p in set(after) - set(before))
    assert new_runs == sorted(f"{m}/{mode_name}/seed0" for m in study["models"])
    table = pd.read_csv(repo_copy / "results" / "tables" / "summary.csv")
    assert (table["mode"] == mode_name).sum() == len(study["models"])
    assert len(before) == len(study["modes"]) * len(study["models"]) and len(after) == len(before) + len(study["models"])
    assert set(table.loc[table["mode"] == mode_name, "scaler"]) == {new_mode[mode_name]["scaler"]["policy"]}

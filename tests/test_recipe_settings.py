"""A recipe's settings are checked from its declaration (the recipe function's signature: annotations, Literal
choices, Annotated ranges; lab/core/settings.py), by `lab validate` and when a run builds the recipe, in one line
naming the recipe, the key and what was expected."""
import re

import pytest
import yaml

from conftest import REPO, tiny_study
from lab.cli import main
from lab.core.config import ConfigError, ModeConfig, validate_study
from lab.fp8 import create_recipe

BAD = [  # (recipe, the words its error must hold)
    ({"name": "fp8-current", "keep_high": "head"},
     "recipe 'fp8-current': keep_high must be a list of strings, got 'head'"),
    ({"name": "nvfp4", "rht": "maybe"}, "recipe 'nvfp4': rht must be a bool, got 'maybe'"),
    ({"name": "fp8-current", "amax_floor": -1}, "recipe 'fp8-current': amax_floor must be >= 0, got -1"),
    ({"name": "fp8-current", "grad_elemnt": "e4m3"},
     "recipe 'fp8-current': unknown setting 'grad_elemnt' (did you mean 'grad_element'?)"),
    ({"name": "fp8-current", "grad_element": "e5m3"},
     "recipe 'fp8-current': grad_element must be one of e4m3, e5m2, got 'e5m3' (did you mean 'e5m2'?)"),
    ({"name": "fp8-delayed", "history_len": 0}, "recipe 'fp8-delayed': history_len must be >= 1, got 0"),
    ({"name": "fp8-delayed", "margin": 1.5}, "recipe 'fp8-delayed': margin must be an int, got 1.5"),
    ({"name": "fp8-delayed", "algorithm": {"name": "ema", "decay": 2}},
     "recipe 'fp8-delayed': algorithm: predictor 'ema': decay must be in (0, 1), got 2"),
    ({"name": "mxfp8", "rounding": "up"}, "recipe 'mxfp8': rounding must be one of floor, rceil, ceil, even"),
    ({"name": "fp8-current", "accumulate": "fp16"}, "recipe 'fp8-current': accumulate must be one of fp32, fast"),
]


@pytest.mark.parametrize("recipe,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_setting_is_refused_in_one_line_naming_it(recipe, words):
    with pytest.raises(ConfigError) as by_create:
        create_recipe(recipe)
    assert words in str(by_create.value) and "\n" not in str(by_create.value)
    with pytest.raises(ConfigError, match=re.escape(words)):  # at run time: the run's mode builds it
        ModeConfig(name="bad", precision="bf16", recipe=recipe).build_recipe()
    study = tiny_study(modes={"fp32": {"precision": "fp32"}, "bad": {"precision": "bf16", "recipe": recipe}})
    with pytest.raises(ConfigError, match=re.escape(f"modes.bad.recipe: {words}")):
        validate_study(study)


def test_lab_validate_prints_it_and_exits_non_zero(tmp_path, capsys):
    recipe = {"name": "fp8-current", "keep_high": "head"}
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(tiny_study(modes={"bad": {"precision": "bf16", "recipe": recipe}})))
    assert main(["validate", "--config", str(config)]) != 0
    assert "recipe 'fp8-current': keep_high must be a list of strings, got 'head'" in capsys.readouterr().err


def test_good_settings_still_build_what_they_say():
    recipe = create_recipe({"name": "fp8-current", "keep_high": ["head", "emb*"], "accumulate": "fast",
                            "amax_floor": 0, "grad_element": "e4m3"})
    assert recipe.keep_high == ("head", "emb*") and recipe.forward.accumulate == "fast"
    assert recipe.grad_weight.a.element == "e4m3" and recipe.forward.a.amax_floor == 0
    nested = create_recipe({"name": "fp8-delayed", "history_len": 16, "initial": "current",
                            "algorithm": {"name": "learned", "model": "auto"}})
    assert nested.amax_algorithm == "learned:model=auto" and nested.history_len == 16
    assert create_recipe({"name": "nvfp4", "rht": False}).name == "nvfp4-no-rht"
    study = tiny_study(modes={"fp32": {"precision": "fp32"},
                              "ok": {"precision": "bf16", "recipe": {"name": "fp8-delayed", "algorithm": "ema"}}})
    assert validate_study(study)["modes"]["ok"]["recipe"]["algorithm"] == "ema"


# the shipped study configs that point at data this machine need not hold (/data/...): validated but for that
ABSENT_DATA = re.compile(r"found '/data/[^']*', which (does not exist|has no config\.json)")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                                        if not p.name.startswith("claims")))
def test_every_shipped_config_still_validates(name, capsys):
    rc = main(["validate", "--config", str(REPO / "configs" / name)])
    out = capsys.readouterr()
    if rc == 0:
        assert out.out.startswith("config OK")
        return
    # one problem per key ("data.path: ...; models.lm.data.path: ..."), each an absent path and nothing else
    problems = re.split(r"; (?=[\w.-]+: )", out.err.split("invalid configuration: ", 1)[1].strip())
    assert all(ABSENT_DATA.search(p) for p in problems), out.err


def test_create_recipe_takes_the_replays_name_key_value_form():
    """create_recipe("NAME:KEY=VALUE,...") is the {name, settings} form (as `lab replay --recipe` writes it), its
    settings checked alike and kept as its spec."""
    from lab.fp8 import create_recipe
    text = create_recipe("fp8-delayed:history_len=16,algorithm=most_recent")
    mapping = create_recipe({"name": "fp8-delayed", "history_len": 16, "algorithm": "most_recent"})
    assert text == mapping and text.spec == {"name": "fp8-delayed", "history_len": 16, "algorithm": "most_recent"}
    with pytest.raises(ConfigError, match="unknown setting 'history' \\(did you mean 'history_len'\\?\\)"):
        create_recipe("fp8-delayed:history=16")

"""FP8 and block-scaled training recipes, emulated exactly on any device.

A recipe (`Recipe`) says, for each of a linear layer's three GEMMs (forward: input x weight; input gradient:
output gradient x weight; weight gradient: output gradient x input), which operand is quantized in which format, at
which granularity and with which scale rule (lab/formats), and how the GEMM accumulates. Everything else of the model
runs in BF16 under `lab.autocast`; which layers stay in BF16 is a setting (`keep_high`). Recipes are registered
functions, one file each in lab/fp8/recipes/ (as scaling policies are in lab/scaling/policies/):
`create_recipe("fp8-current")`, or `{name: mxfp8, rounding: floor}` in a study's mode. `convert(model, recipe)` swaps the model's nn.Linear layers
for `RecipeLinear` (lab/fp8/linear.py).
"""
from lab.fp8.recipe import (ACCUMULATE, RECIPES, Gemm, Recipe, _load_recipe_files, common_settings,  # noqa: F401
                            create_recipe, register_recipe)
# the entry points a user's loop needs (docs/fp8.md, "In your own model"), beside create_recipe
from lab.fp8.linear import convert  # noqa: F401,E402
from lab.fp8.model_census import torchao_autocast_input  # noqa: F401,E402

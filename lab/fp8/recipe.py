"""Recipes: which operand of which GEMM is quantized how (`Gemm`, `Recipe`), the registry of recipe functions
(`register_recipe`, one file each in lab/fp8/recipes/) and `create_recipe`, which checks a config's settings against
the recipe's declaration (lab/core/settings.py) before building it. lab/fp8/__init__.py re-exports these with the
entry points a user's loop needs."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Annotated, Literal

from lab.core.errors import ConfigError, did_you_mean
from lab.core.settings import Range, check_settings, declared_settings, parse_spec
from lab.formats import OperandFormat

ACCUMULATE = ("fp32", "fast", "promote")


@dataclass(frozen=True)
class Gemm:
    """One GEMM's operands (None: high precision, the autocast dtype's values) and its accumulation: fp32 (the
    tensor-core contract), fast (Hopper's FP8 accumulator, no promotion) or promote (partial sums promoted to FP32
    every 128 products: CUTLASS, DeepSeek-V3); lab/formats/accumulate.py states the model. k_splits: K cut into
    that many parts, each accumulated so, added in FP32 (cuBLAS's split-K, which it chooses for some shapes)."""
    a: OperandFormat | None
    b: OperandFormat | None
    accumulate: str = "fp32"
    k_splits: int = 1

    def __post_init__(self):
        # the Hadamard transform leaves a product unchanged only when both operands are rotated along k
        if (self.a is not None and self.a.hadamard) != (self.b is not None and self.b.hadamard):
            raise ConfigError("a GEMM's random Hadamard transform rotates both of its operands or neither")


@dataclass(frozen=True)
class Recipe:
    """A training recipe below 16 bits. forward: (input, weight); grad_input: (grad_output, weight);
    grad_weight: (grad_output, input). history_len / margin / amax_algorithm: delayed scaling's amax history
    (Transformer Engine's amax_history_len, margin, amax_compute_algo).
    keep_high: module names (fnmatch patterns) whose linears stay in BF16."""
    name: str
    forward: Gemm
    grad_input: Gemm
    grad_weight: Gemm
    keep_high: tuple[str, ...] = ("head",)
    history_len: int = 1024
    margin: int = 0
    amax_algorithm: str = "max"  # delayed scaling: the predictor of the next amax (lab/scaling/predictors), as a spec
    initial: str = "one"  # delayed scaling with an empty history: scale 1 (TE) or the tensor's own amax ("current")
    source: str = ""
    # the settings it was built from ({name, **settings}: create_recipe's spec), what a recording writes to its
    # config.yaml so that lab replay can rebuild it; not part of what the recipe computes (compare=False)
    spec: dict = dataclasses.field(default_factory=dict, compare=False)

    def operands(self):
        """(gemm name, role, operand format) for every quantized operand."""
        for gemm, roles in (("forward", ("input", "weight")), ("grad_input", ("grad_output", "weight")),
                            ("grad_weight", ("grad_output", "input"))):
            g = getattr(self, gemm)
            for role, fmt in zip(roles, (g.a, g.b)):
                if fmt is not None:
                    yield gemm, role, fmt

    def block(self) -> int:
        """The multiple a linear's in and out features must be for every GEMM's k to hold whole blocks: 32 (MX), 16
        (NVFP4, and its Hadamard transform), 1 (per tensor, row, tile or block: a short tile or block is fine)."""
        sizes = {"mx": 32, "nvfp4": 16, "nvfp4-2d": 16}
        return max([sizes.get(f.granularity, 16 if f.hadamard else 1) for _, _, f in self.operands()] or [1])

    def delayed(self) -> bool:
        return any(f.scale == "delayed" for _, _, f in self.operands())

    def with_accumulate(self, accumulate: str, k_splits: int = 1) -> "Recipe":
        """The same recipe with its forward GEMM accumulating as `accumulate`, its K cut into `k_splits` parts:
        torchao's float8 training turns Hopper's fast accumulation on for the output GEMM only
        (gemm_config_output.use_fast_accum), the two gradient GEMMs accumulating in full precision, and so does this
        setting (a high-precision forward keeps FP32). A split is a setting of the Hopper model only."""
        if accumulate not in ACCUMULATE:
            raise ConfigError(f"accumulate must be one of {', '.join(ACCUMULATE)}, got {accumulate!r}")
        if type(k_splits) is not int or k_splits < 1 or (k_splits > 1 and accumulate == "fp32"):
            raise ConfigError(f"k_splits must be a positive integer, > 1 only with accumulate fast or promote; got "
                              f"{k_splits!r} with {accumulate}")
        if self.forward.a is None:
            return self
        return dataclasses.replace(self, forward=dataclasses.replace(self.forward, accumulate=accumulate,
                                                                     k_splits=k_splits))


RECIPES: dict = {}


def register_recipe(name: str):
    """Register a function that returns a Recipe (its keyword arguments: the recipe's settings)."""
    def wrap(fn):
        if name in RECIPES and RECIPES[name] is not fn:
            raise ValueError(f"recipe {name!r} is already registered (by {RECIPES[name].__module__})")
        RECIPES[name] = fn
        return fn
    return wrap


def _load_recipe_files() -> None:
    from lab.fp8 import recipes
    for info in pkgutil.iter_modules(recipes.__path__):
        importlib.import_module(f"lab.fp8.recipes.{info.name}")


def common_settings(accumulate: Annotated[Literal[ACCUMULATE] | None, "the forward GEMM's accumulation: fp32 "
                                          "(the contract), fast (Hopper's FP8 accumulator), promote (every 128 "
                                          "products into FP32)"] = None,
                    keep_high: Annotated[list[str] | None, "module-name patterns (fnmatch) whose linears stay in "
                                         "BF16; null: [head]"] = None,
                    k_splits: Annotated[int, Range(ge=1), "the forward GEMM's K cut in that many parts (cuBLAS's "
                                        "split-K), with fast or promote"] = 1):
    """The settings every recipe takes besides its own, declared as a recipe's are (for check_settings):
    accumulate, the forward GEMM's accumulation; keep_high, module-name patterns whose linears stay in BF16;
    k_splits, the forward GEMM's K cut in that many parts (cuBLAS's split-K; with accumulate fast or promote)."""


def create_recipe(spec) -> Recipe:
    """A Recipe from a name, ``"NAME:KEY=VALUE,..."`` (as `lab replay --recipe` takes it) or {name: ..., **settings}:
    its own settings (the recipe function's keyword arguments) and common_settings', every one checked against its
    annotation before the recipe is built."""
    _load_recipe_files()
    name, params = parse_spec(spec, "recipe")
    given = dict(params)  # what the recipe records as its spec (config.yaml, lab replay)
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}{did_you_mean(str(name), RECIPES)}; known: "
                          f"{', '.join(sorted(RECIPES))}")
    own, _ = declared_settings(RECIPES[name])
    check_settings(f"recipe {name!r}", {**own, **declared_settings(common_settings)[0]}, params)
    accumulate = params.pop("accumulate", None)
    k_splits = params.pop("k_splits", 1)
    keep_high = params.pop("keep_high", None)
    recipe = RECIPES[name](**params)
    if accumulate is not None or k_splits != 1:
        try:
            recipe = recipe.with_accumulate(accumulate or "fp32", k_splits)
        except ConfigError as e:
            raise ConfigError(f"recipe {name!r}: {e}") from None
    if keep_high is not None:
        recipe = dataclasses.replace(recipe, keep_high=tuple(keep_high))
    return dataclasses.replace(recipe, spec={"name": name, **given})

"""fp8-delayed: Transformer Engine's `DelayedScaling`: one scale per tensor from the amax its history predicts,
divided by 2^margin; the format HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere.

`algorithm` is the predictor of the next amax (lab/scaling/predictors): TE's two, "max" (the largest amax of the last
`history_len` steps, TE's default) and "most_recent", or any registered one by name or as {name: ..., settings}
(`ema`, `trend`, `learned`; docs/controllers.md). `initial`: the scale while a tensor's history is empty (its first
step): "one", TE's (which flushed 85% of the LM's output gradients at step 0, docs/controllers.md), or "current",
the step's own amax (torchao's delayed scaling)."""
from typing import Annotated, Literal

from lab.core.errors import ConfigError
from lab.core.settings import Range
from lab.fp8.recipe import Gemm, Recipe, register_recipe
from lab.fp8.recipes import fp8


@register_recipe("fp8-delayed")
def fp8_delayed(history_len: Annotated[int, Range(ge=1), "steps of amax history kept per operand (TE's "
                                     "amax_history_len)"] = 1024,
                margin: Annotated[int, Range(ge=0), "binades of headroom under the format's maximum (TE's "
                                  "margin)"] = 0,
                format: Annotated[Literal["hybrid", "e4m3"], "hybrid: E5M2 gradients; e4m3: every operand "
                                  "E4M3"] = "hybrid",
                algorithm: Annotated[str | dict, "the predictor of the next amax from the history: max, "
                                     "most_recent (TE's), or any registered predictor (docs/controllers.md)"] = "max",
                initial: Annotated[Literal["one", "current"], "a tensor's first step, its history empty: scale 1 "
                                   "(TE) or its own amax (torchao's delayed)"] = "one") -> Recipe:
    # initial: one is TE's (scale 1 until the history holds an amax), current the step's own amax (torchao's)
    from lab.scaling.predictors import create_predictor, spec_string
    try:
        predictor = create_predictor(algorithm, history="fp8")  # checked here: a bad one fails at validation
    except ConfigError as e:
        raise ConfigError(f"recipe 'fp8-delayed': algorithm: {e}") from None
    x, w = fp8("e4m3", scale="delayed"), fp8("e4m3", scale="delayed")
    g = fp8("e5m2" if format == "hybrid" else "e4m3", scale="delayed")
    return Recipe("fp8-delayed", Gemm(x, w), Gemm(g, w), Gemm(g, x), history_len=history_len, margin=margin,
                  amax_algorithm=spec_string(predictor.name, predictor.settings()), initial=initial,
                  source="Transformer Engine DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=1024, "
                         "amax_compute_algo='max')")

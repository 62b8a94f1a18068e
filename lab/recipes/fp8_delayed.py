"""fp8-delayed: Transformer Engine's `DelayedScaling`: one scale per tensor from the largest amax of the last
`history_len` steps (amax_compute_algo "max") or the most recent one ("most_recent"), divided by 2^margin; the format
HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere."""
from lab.core.errors import ConfigError
from lab.fp8 import Gemm, Recipe, register_recipe
from lab.recipes import fp8


@register_recipe("fp8-delayed")
def fp8_delayed(history_len: int = 1024, margin: int = 0, format: str = "hybrid",
                algorithm: str = "max") -> Recipe:
    if format not in ("hybrid", "e4m3") or algorithm not in ("max", "most_recent"):
        raise ConfigError(f"fp8-delayed: format must be hybrid or e4m3 and algorithm max or most_recent, got "
                          f"{format!r}, {algorithm!r}")
    if not (isinstance(history_len, int) and history_len >= 1) or not isinstance(margin, int):
        raise ConfigError(f"fp8-delayed: history_len must be an int >= 1 and margin an int, got {history_len!r}, "
                          f"{margin!r}")
    x, w = fp8("e4m3", scale="delayed"), fp8("e4m3", scale="delayed")
    g = fp8("e5m2" if format == "hybrid" else "e4m3", scale="delayed")
    return Recipe("fp8-delayed", Gemm(x, w), Gemm(g, w), Gemm(g, x), history_len=history_len, margin=margin,
                  amax_algorithm=algorithm,
                  source="Transformer Engine DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=1024, "
                         "amax_compute_algo='max')")

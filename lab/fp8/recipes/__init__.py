"""Training recipes below 16 bits, one file each (registered with lab.fp8.register_recipe, imported by
lab.fp8.create_recipe). A new recipe is a file here and a mode line in a study config (docs/fp8.md)."""
from lab.formats import OperandFormat


def fp8(element: str = "e4m3", granularity: str = "tensor", scale: str = "current", **kw) -> OperandFormat:
    """One FP8 operand: shorthand for the recipe files."""
    return OperandFormat(element=element, granularity=granularity, scale=scale, **kw)

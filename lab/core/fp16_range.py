"""FP16's limits and the rounding bounds of a cast to FP16, from a ``finfo`` of IEEE binary16, without torch.

lab/core/fp16.py applies :func:`bounds` to ``torch.finfo(torch.float16)`` (what the census, the replay and the
policies use); the report's figures apply it to ``numpy.finfo(numpy.float16)``, the same IEEE format, so a figures
job need not import torch (~4 s here) to draw FP16's lines. tests/test_numerics.py checks both give the same numbers.
"""
from __future__ import annotations


def bounds(fi) -> dict:
    """``fi``: a finfo of FP16 (torch's or numpy's: ``max``, ``eps``, ``smallest_normal``). Returns MAX (65504),
    SMALLEST_SUBNORMAL (2^-24), SMALLEST_NORMAL (2^-14), UNDERFLOW_BOUND (|v| <= 2^-25 rounds to 0), NORMAL_BOUND
    (|v| >= 2^-14 - 2^-25 rounds to a normal) and OVERFLOW_BOUND (|v| >= 65520 rounds to inf), as Python floats."""
    f_max, eps, normal = float(fi.max), float(fi.eps), float(fi.smallest_normal)
    subnormal = normal * eps
    top_binade = f_max / (2 - eps)  # max is (2 - eps) * 2^e, its ulp eps * 2^e
    return {"MAX": f_max, "SMALLEST_SUBNORMAL": subnormal, "SMALLEST_NORMAL": normal,
            # exactly half the smallest subnormal is a tie and goes to the even 0
            "UNDERFLOW_BOUND": subnormal / 2,
            # the tie between the largest subnormal (odd) and 2^-14 goes up
            "NORMAL_BOUND": normal - subnormal / 2,
            # the tie above max (odd) goes up, to inf
            "OVERFLOW_BOUND": f_max + eps * top_binade / 2}

"""Planted faults (train.faults) as the summary and the figures show them: the steps, and one line per mode.
Only pandas: the figures job imports it without the study's statistics (scipy, ~1.5 s to import here)."""
from __future__ import annotations

import pandas as pd


def planted_steps(runs: pd.DataFrame) -> list[int]:
    """The steps at which any of these runs planted a fault (metrics.json planted_steps; none in a real run)."""
    if "planted_steps" not in runs:
        return []
    return sorted({int(s) for steps in runs["planted_steps"] if isinstance(steps, list) for s in steps})


def planted_lines(runs: pd.DataFrame | None) -> list[str]:
    """One line per (model, mode) whose runs planted faults (train.faults): where, and what was counted."""
    if runs is None or "planted_steps" not in runs:
        return []
    out = []
    for (model, mode), g in runs.groupby(["model", "mode"], sort=False):
        planted = planted_steps(g)
        if planted:
            out.append(f"Planted faults, {model} / {mode}: steps {', '.join(map(str, planted))}; counted "
                       f"{g['overflow_steps'].mean():g} overflow and {g['skipped_steps'].mean():g} skipped steps "
                       f"per run (`python -m lab diagnose` compares them step by step).")
    return [""] + out if out else []

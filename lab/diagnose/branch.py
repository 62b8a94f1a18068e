"""The branch rule of the diagnosis: in a vision-language model (lab/models/multimodal.py), which branch the first
non-finite value of each overflow step came from, and whether it came from the forward or the backward pass.

A run is a vision-language model's when its config.yaml says so: its preset is a vision-language one (``vlm-*``)
or its family loads a pre-trained encoder (``models.<family>.encoder``). Its module names then carry the branch in
their first component, which :func:`lab.models.multimodal.branch_of` reads: ``encoder.*`` the vision branch,
``projector``, ``decoder.*`` the language branch. Other families get no branch (their report is unchanged).

The origin of an overflow step, from steps.csv, in this order:

* **forward**: a replay found a module whose forward output left FP16's range (``forward_overflow_module``): its
  branch. A non-finite loss without such a module is the forward pass too (the loss is computed there), its branch
  not located: the gradient columns then name where the NaN loss's gradient showed first, not where it came from.
* **backward**: a finite loss, and the first non-finite gradient in backward order (``first_nonfinite_layer``,
  ``first_nonfinite_source``): its branch.
* neither recorded: not located.
"""
from __future__ import annotations

import math

from lab.diagnose.record import Diagnosis, _Builder, _Step

LABELS = {"encoder": "vision branch (encoder)", "projector": "projector", "decoder": "language branch (decoder)",
          "other": "outside the three branches", "unlocated": "not located"}
ORIGINS = ("forward", "backward")


def is_vision_language(config: dict) -> bool:
    """From config.yaml alone (no model is built): a vision-language preset, or a family with a pre-trained
    encoder."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    preset = model.get("preset")
    return (isinstance(preset, str) and preset.startswith("vlm")) or isinstance(model.get("encoder"), dict)


def branch(name: str) -> str:
    """'encoder', 'projector', 'decoder' (lab.models.multimodal.branch_of), or 'other'."""
    from lab.models.multimodal import branch_of
    return branch_of(name) or "other"


def label(d: Diagnosis, name: str | None) -> str:
    """' in the vision branch (encoder)' for a module (or 'module (source)') of a vision-language run (after
    branch_origins); '' for any other run."""
    if d.overflow_branches is None or not name:
        return ""
    b = branch(_module(name))
    return f" in the {LABELS[b]}" if b != "other" else f" ({LABELS[b]})"


def _module(layer: str) -> str:
    """The module's name from _Step.layer's 'name (source)'."""
    return layer.split(" (", 1)[0]


def origin(s: _Step) -> tuple[str | None, str | None, str | None]:
    """(forward | backward | None, the module it names or None, that module as reported) of one overflow step:
    'encoder.blocks.1.mlp.fc2 (Linear)' (forward: its class), 'decoder.head (activation_grad)' (backward: the
    gradient's source)."""
    if s.forward_module:
        return "forward", s.forward_module, s.forward_module + (f" ({s.forward_type})" if s.forward_type else "")
    if not math.isfinite(s.loss):
        return "forward", None, None
    if s.layer:
        return "backward", _module(s.layer), s.layer
    return None, None, None


def branch_origins(d: Diagnosis, steps: list[_Step], config: dict) -> None:
    """``d.overflow_branches`` of a vision-language run ({} when nothing overflowed; None for other runs): per
    branch, the overflow steps whose first non-finite value came from it, how many from each pass, the modules."""
    if not is_vision_language(config):
        return
    found: dict[str, dict] = {}
    for s in steps:
        if not (s.found_inf or not math.isfinite(s.loss)):
            continue
        where, module, shown = origin(s)
        key = branch(module) if module else "unlocated"
        e = found.setdefault(key, {"label": LABELS[key], "steps": 0, "forward": 0, "backward": 0, "unknown": 0,
                                   "first_step": s.step, "forward_modules": {}, "backward_modules": {}})
        e["steps"] += 1
        e[where or "unknown"] += 1
        if shown:
            e[f"{where}_modules"][shown] = e[f"{where}_modules"].get(shown, 0) + 1
    d.overflow_branches = dict(sorted(found.items(), key=lambda kv: (kv[0] == "unlocated", -kv[1]["steps"],
                                                                     kv[1]["first_step"])))


def branch_findings(b: _Builder, d: Diagnosis) -> None:
    """Say per branch how many overflow steps started there, from which pass (after branch_origins)."""
    if not d.overflow_branches:
        return
    total = sum(e["steps"] for e in d.overflow_branches.values())
    what = {"forward": "a module's output beyond FP16's range", "backward": "the first non-finite gradient"}
    parts = []
    for key, e in d.overflow_branches.items():
        if key == "unlocated":
            why = ([f"{e['forward']} with a non-finite loss: the forward pass, in a module no replay located (the "
                    "gradient columns say where its NaN showed first, not where it began)"] if e["forward"] else []
                   ) + ([f"{e['unknown']} with no layer recorded"] if e["unknown"] else [])
            parts.append(f"not located on {e['steps']} of {total} ({'; '.join(why)})")
            continue
        passes = []
        for p in ORIGINS:
            if e[p]:
                mods = sorted(e[f"{p}_modules"].items(), key=lambda kv: -kv[1])[:2]
                passes.append(f"the {p} pass on {e[p]} ({what[p]}: " + ", ".join(f"{m} x{c}" for m, c in mods)
                              + ")")
        parts.append(f"the {e['label']} on {e['steps']} of {total} overflow steps (first at step "
                     f"{e['first_step']}), from " + " and ".join(passes))
    b.find("overflow_branch", "info", "where each overflow step's first non-finite value came from, by branch of "
           "the vision-language model: " + "; ".join(parts), branches=d.overflow_branches)

"""What `lab train` refuses in a resolved run that the config alone shows: one check, which `lab validate` (and the
workflow's config check, workflow/rules/common.smk) asks of every run a study expands to, and `lab train`
(lab/run/train.py) of its run before the run directory is touched, so that the two cannot disagree.

Each refusal is one line naming the family and mode, the key, its value and what is allowed. The model-dependent
checks (gradient checkpointing's blocks, QAT's group size, train.clip_groups' prefixes) read the run's model built on the meta device: names and
shapes, no memory, no weights read (a fine-tune's base run and a vision-language model's encoder need not exist yet).
A model loaded from a local Hugging Face folder (finetune.base_model) is not built here: its QAT group size is
checked when the run builds it (lab/models/qat.py prepare, the same function).
"""
from __future__ import annotations

import dataclasses

from lab.core.errors import ConfigError
from lab.core.schema import invalid

#: the data sets a language model trains on: the ones whose positions train.position_probe reads
LM_DATA = ("pydoc", "text", "tokens")


def data_shape(data: dict) -> tuple[str, int, int, int]:
    """(task, classes or vocabulary, image channels, image side or context) of a config's data block, from the
    config alone (no files are read)."""
    name = data["name"]
    if name in LM_DATA:
        return "lm", int(data["vocab_size"]), 0, int(data["context"])
    if name == "digits-vqa":  # an image and a question packed in one row (lab/data/vqa.py)
        from lab.data.vqa import VOCAB
        return "vqa", len(VOCAB), 1, int(data["image_size"])
    classes, chans = {"digits": (10, 1), "cifar10": (10, 3), "imagenet": (1000, 3)}[name]
    return "classify", classes, chans, int(data["image_size"])


def run_problems(run) -> list[str]:
    """The refusals of one resolved run (lab.core.config.RunConfig), each one line; [] when `lab train` would
    accept it. Nothing here reads the seed: every seed of a (family, mode) gets the same answer."""
    where = f"models.{run.model.family}, mode {run.mode.name}"
    t, preset = run.train, run.model.preset
    task, classes, chans, size = data_shape(dataclasses.asdict(run.data))
    problems = []
    if t.position_probe and task != "lm":
        problems.append(f"{where}: train.position_probe: true reads a language model's gradients by position; "
                        f"preset {preset!r} trains on {run.data.name} ({task}): expected false, or data a language "
                        f"model reads ({', '.join(LM_DATA)})")
    if not (t.gradient_checkpointing or run.mode.qat is not None or t.clip_groups):
        return problems
    if run.model.finetune is not None and "base_model" in run.model.finetune:  # a Hugging Face folder's model
        model = None
    else:
        import torch
        with torch.device("meta"):
            model = run.model.build(classes, chans, size, run.mode.precision)
    if t.gradient_checkpointing:
        from lab.models.gpt import checkpoint_target
        if model is None or checkpoint_target(model) is None:
            problems.append(f"{where}: train.gradient_checkpointing: true recomputes the blocks of the lab's GPT "
                            f"(gpt-* presets, the decoder of vlm-digits); preset {preset!r} has none: expected false")
    if t.clip_groups and model is not None:  # a prefix that names no trainable parameter of this model
        from lab.run.loop import clip_groups
        try:
            clip_groups(model, t.clip_groups)
        except ConfigError as e:
            problems.append(f"{where}: {e}")
    if run.mode.qat is not None and model is not None:
        from lab.models import qat
        try:
            problem = qat.group_size_problem(model, run.mode.qat)
        except ConfigError as e:  # a --set that broke the settings themselves
            problem = str(e)
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


def check_run(run) -> None:
    """`lab train`'s refusal of a run (ConfigError, one line: the same words `lab validate` prints), before any
    file of the run is written."""
    problems = run_problems(run)
    if problems:
        raise invalid(problems)


def check_study(study: dict) -> None:
    """`lab validate`'s (and the workflow's) refusal of a validated study, in the words check_run says them: the
    run_problems of every (family, mode) it trains (its first seed: the seed changes none of them)."""
    from lab.core.config import resolve_run
    from lab.core.study import family_modes, family_seeds
    problems = []
    for family in study["models"]:
        for mode in family_modes(study, family):
            problems += run_problems(resolve_run(study, family, mode, family_seeds(study, family)[0]))
    if problems:
        raise invalid(problems)

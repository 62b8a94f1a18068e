"""A fitted scale model as a file: plain JSON (numbers, names, the runs it learned from), versioned, read without
executing anything (the "weights only" of a checkpoint, in a format a reviewer can diff).

Where a model is looked up: a path as given (relative to the working directory), else
``results/controllers/models/<name>.json`` of the lab's own checkout. ``auto`` names the lab's committed model for the
history kind (``learned-fp16``, ``learned-fp8``; ``rl-fp16`` for the controller)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from lab.core.errors import ConfigError

#: the artefact format this lab writes and reads
FORMAT = "loss-scale-lab/scale-model/1"
ROOT = Path(__file__).resolve().parents[3]
DIR = Path("results") / "controllers" / "models"


class MissingModel(ConfigError):
    """No artefact where a model setting points (yet: a study's fit rule may write it later)."""


def resolve(model: str, default_name: str) -> Path:
    """The file a model setting names (see the module docstring); ConfigError naming where it looked."""
    name = default_name if model in ("", "auto") else model
    tried = [Path(name)]
    if not name.endswith(".json"):
        tried.append(Path(name + ".json"))
    tried += [ROOT / DIR / (Path(name).name if name.endswith(".json") else name + ".json")]
    for path in tried:
        if path.is_file():
            return path
    raise MissingModel(f"no fitted scale model {model!r}: looked for {', '.join(str(p) for p in tried)}; fit one "
                      f"with `lab fit-controller RUN_DIRS... --out FILE` (docs/controllers.md)")


def exists(model: str, default_name: str) -> bool:
    try:
        resolve(model, default_name)
    except MissingModel:
        return False
    return True


def load(model: str, default_name: str, kind: str, features: tuple | None = None, coefs: int | None = None,
         missing_ok: bool = False) -> dict | None:
    """The artefact's contents, checked: its format, its kind (``quantile-linear``, ``rl-linear``), finite
    numbers and, given them, the features it was fitted on and its number of coefficients; ConfigError otherwise.
    ``missing_ok``: None where no file is there yet (a study's fit rule writes it after validation)."""
    try:
        path = resolve(model, default_name)
    except MissingModel:
        if missing_ok:
            return None
        raise
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a scale model ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kind") != kind:
        raise ConfigError(f"{path}: expected a {FORMAT} file of kind {kind!r}, got format "
                          f"{data.get('format') if isinstance(data, dict) else None!r}, kind "
                          f"{data.get('kind') if isinstance(data, dict) else None!r}")
    coef = data.get("coef")
    if not isinstance(coef, list) or not all(isinstance(c, (int, float)) and math.isfinite(c) for c in coef):
        raise ConfigError(f"{path}: coef must be a list of finite numbers")
    if features is not None and (tuple(data.get("features", ())) != tuple(features) or len(coef) != coefs):
        raise ConfigError(f"{path} was fitted on features {data.get('features')}; this lab computes "
                          f"{list(features)}: fit it again")
    data["path"] = str(path)
    return data


def save(data: dict, path: str | Path) -> Path:
    """Write an artefact atomically (the format key added)."""
    from lab.core import files
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write_text(path, json.dumps({"format": FORMAT, **data}, indent=1) + "\n")
    return path

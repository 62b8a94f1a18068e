"""Command line: `python -m lab COMMAND ...` (`python -m lab --help` lists the commands). The workflow's rules call
these.

Every command is a module in lab/commands/, its parser and its handler together (``add_parser(sub)``, ``main(args)``:
lab/commands/__init__.py); this module only collects them and dispatches, and refuses the bad input a handler raises.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil

from lab import commands
from lab.commands import refuse
from lab.core.config import ConfigError
from lab.core.runfiles import RunFileError

#: where `--help` lists lab/commands/'s modules (their commands in the order each adds them); a module not named here
#: is listed after these, alphabetically
HELP_ORDER = ("train", "aggregate", "validate", "diagnose", "replay", "inspect", "compare", "figures", "first_steps",
              "tensorboard", "summary_html", "notebooks", "claims", "job_server", "prepare_text", "fit_controller",
              "judge_controllers", "recipes_tables", "rl", "rl_dpo")


def _command_modules() -> list:
    """Every module in lab/commands/, in HELP_ORDER."""
    names = sorted((info.name for info in pkgutil.iter_modules(commands.__path__)),
                   key=lambda n: (HELP_ORDER.index(n) if n in HELP_ORDER else len(HELP_ORDER), n))
    return [importlib.import_module(f"{commands.__name__}.{name}") for name in names]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab", description="Loss-Scale Lab")
    sub = p.add_subparsers(dest="command", required=True)
    for module in _command_modules():
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except ConfigError as e:
        return refuse(e)
    except FileNotFoundError as e:
        return refuse(e)
    except RunFileError as e:  # a damaged file in a run directory (lab/core/runfiles.py): its path and line
        return refuse(e)

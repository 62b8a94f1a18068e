"""The command line's commands, one file each (or one per tightly-coupled family: replay.py holds `replay` and
`replay-table`, rl.py the GRPO study's `rl-*`, rl_dpo.py the DPO family's `rl-dpo-*`).

A command is a module here with two functions: ``add_parser(sub)`` adds its subparser(s) to ``python -m lab``'s
and binds each to its handler (``p.set_defaults(handler=main)``), and ``main(args)`` runs it and returns the exit
status. lab/cli.py imports every module in this folder, so a new command is one file dropped here (cli.HELP_ORDER
only fixes where ``--help`` lists the existing ones). Bad input a handler raises as ``ConfigError``,
``FileNotFoundError`` or ``RunFileError`` is refused by lab.cli.main (one line on stderr, exit status 2); a handler
refuses its own errors with :func:`refuse`. Nothing heavy at import: every command builds the whole parser, and
``lab figures`` must not pay torch's import; a handler imports what it drives.
"""
from __future__ import annotations

import sys


def refuse(e: BaseException) -> int:
    """Bad input: one line on stderr (the key or path, what was expected, what was found), exit status 2."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines) or type(e).__name__}", file=sys.stderr)
    return 2


def print_written(written, under) -> int:
    """Each written path on a line and exit status 0; none written: one line on stderr naming ``under`` (where runs
    were looked for), exit status 2."""
    if not written:
        print(f"error: no runs found under {under}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0

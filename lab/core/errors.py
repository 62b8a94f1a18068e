"""ConfigError and the hint its messages carry, in a module of their own: the checks below config.py (planted
faults, lab/core/fault_spec.py) raise them without importing config, which calls those checks."""
from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration that cannot be run; the message names the key and what is allowed."""


def did_you_mean(word, choices) -> str:
    """' (did you mean 'x'?)' for the closest of ``choices`` to a misspelt ``word``, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""

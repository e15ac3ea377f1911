"""The flag checks the bench scripts share, so that bad input ends as the command line's does (one line on
stderr, exit status 2, nothing timed): comma lists of positive integers (``--widths 1,8,16``,
``--difficulties 1,2,3``, ``--batch 16``) and lower bounds.

Each raises :class:`rdepth.errors.RdepthError`; a script's ``__main__`` runs ``main`` through
:func:`rdepth.cli.main.run_command`, which prints ``bench/NAME.py: error: ...`` and returns 2. The scripts'
parsers are :class:`rdepth.cli.main.OneLineParser` (argparse's own errors one line, status 2).
"""

from __future__ import annotations

import argparse

from rdepth.errors import RdepthError


def positive_ints(flag: str, text: str, empty: bool = False) -> list[int]:
    """The integers of the comma list ``text`` given to ``flag``, each >= 1, in order (blank entries
    skipped); RdepthError naming the flag for anything else, and for no integer at all unless ``empty``
    (a flag whose empty list means "none of these")."""
    entries = [entry.strip() for entry in str(text).split(",") if entry.strip()]
    try:
        values = [int(entry) for entry in entries]
    except ValueError:
        raise RdepthError(f"{flag} takes integers >= 1 separated by commas, got {text!r}") from None
    if any(value < 1 for value in values):
        raise RdepthError(f"{flag} takes integers >= 1 separated by commas, got {text!r}")
    if not values and not empty:
        raise RdepthError(f"{flag} needs at least one integer >= 1 (comma-separated), got {text!r}")
    return values


def at_least(args: argparse.Namespace, least: int, *names: str) -> None:
    """RdepthError naming the first of ``names`` (attributes of ``args``) whose value is below ``least``."""
    for name in names:
        value = getattr(args, name)
        if value < least:
            raise RdepthError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")

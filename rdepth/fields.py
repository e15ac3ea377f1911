"""Config fields that carry their own command-line help (torch-free).

Every config dataclass declares its fields with :func:`option`, so the help text,
the default and the flag live in one place; :mod:`rdepth.cli.options` turns the
fields into flags. Nothing else writes a default or a help string twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, required: bool = False,
           default_text: str | None = None, metavar: str | None = None, cli: bool = True) -> Any:
    """A dataclass field with its command-line help.

    ``required``: the flag must be given on the command line (the field keeps a
    default for the Python API). ``default_text``: how to show a ``None``
    default in ``--help`` (e.g. "the model's block size"). ``cli=False``: no flag.
    """
    metadata = {"help": help, "required": required, "default_text": default_text, "metavar": metavar, "cli": cli}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)

"""Map config dataclass fields onto command-line flags, one flag per field.

Flags default to ``None`` (argparse.SUPPRESS-like) so that only what the user
typed overrides the preset or the saved config; values are validated by the
dataclass itself, whose errors name the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from rdepth.errors import RdepthError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation: Any) -> type:
    """The scalar type behind ``int``, ``int | None``, ``float``, ``str``, ``bool``."""
    if isinstance(annotation, str):
        annotation = annotation.replace(" ", "")
        for name, kind in (("bool", bool), ("int", int), ("float", float)):
            if annotation.startswith(name):
                return kind
        return str
    origin = typing.get_origin(annotation)
    if origin is not None:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0]) if args else str
    return annotation if annotation in (bool, int, float) else str


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    title: str | None = None,
    help_overrides: dict[str, str] | None = None,
) -> None:
    """Add ``--field-name`` for every field of ``cls`` not in ``skip``."""
    group = parser.add_argument_group(title or cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = _scalar_type(field.type)
        text = (help_overrides or {}).get(field.name, f"{field.name} (default {field.default!r})")
        dest = f"{cls.__name__}.{field.name}"
        if kind is bool:
            group.add_argument(_flag(field.name), dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            group.add_argument(_flag(field.name), dest=dest, type=_typed(kind, field.name),
                               default=None, metavar=kind.__name__.upper(), help=text)


def _typed(kind: type, name: str):
    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')} expects {kind.__name__}, got {text!r}")

    convert.__name__ = kind.__name__
    return convert


def overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` the user set on the command line."""
    prefix = f"{cls.__name__}."
    return {
        key[len(prefix):]: value
        for key, value in vars(args).items()
        if key.startswith(prefix) and value is not None
    }


def build(cls: type, base: dict[str, Any], args: argparse.Namespace):
    """``cls(**base)`` with the command-line overrides applied and validated."""
    values = {**base, **overrides(args, cls)}
    try:
        return cls(**values)
    except TypeError as exc:
        raise RdepthError(f"bad {cls.__name__}: {exc}") from None

"""Map config dataclass fields onto command-line flags, one flag per field.

A field's flag, type, help text and default all come from the dataclass (see
:func:`rdepth.fields.option`): scalars (``int``, ``float``, ``str``, ``bool`` as
``--x/--no-x``), comma-separated tuples (``tuple[int, ...]``: ``--k-max 8`` or
``--k-max 8,12,4``), and per-name grids (``dict[str, tuple[float, ...]]``: a
repeatable ``--grid kl=1e-5,1e-4``). Flags default to ``None`` so that only what
the user typed overrides the preset or the saved config; values are validated by
the dataclass itself, whose errors name the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any

from rdepth.errors import RdepthError, check_utf8


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _scalar(kind: Any) -> type:
    return kind if kind in (bool, int, float, str) else str


def field_kinds(cls: type) -> dict[str, type]:
    """Each field of the dataclass ``cls`` and the scalar type a flag's text converts to (bool, int, float
    or str; Optional unwrapped), as the flags built from ``cls`` convert them."""
    hints = typing.get_type_hints(cls)
    return {field.name: _scalar(_strip_optional(hints[field.name])) for field in dataclasses.fields(cls)}


def check_typed_value(name: str, value: Any) -> None:
    """A one-line error for what no flag means: a non-finite float (nan, inf: every float field is a
    finite quantity) and text that is not valid UTF-8 (argv bytes Python kept as surrogates);
    ``value`` may be a tuple or list of them."""
    if isinstance(value, (tuple, list)):
        for item in value:
            check_typed_value(name, item)
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise RdepthError(f"{name} must be a finite number, got {value!r} ({flag_name(name)})")
    if isinstance(value, str):
        check_utf8(flag_name(name), value)


def _converter(kind: type, name: str):
    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag_name(name)} expects {kind.__name__}, got {text!r}") from None

    convert.__name__ = kind.__name__
    return convert


def _tuple_converter(kind: type, name: str):
    def convert(text: str):
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{flag_name(name)} expects a comma-separated list, got {text!r}")
        try:
            return tuple(kind(part) for part in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag_name(name)} expects comma-separated {kind.__name__} values, got {text!r}"
            ) from None

    convert.__name__ = f"{kind.__name__} list"
    return convert


def _grid_converter(kind: type, name: str):
    values = _tuple_converter(kind, name)

    def convert(text: str):
        key, sep, rest = text.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{flag_name(name)} expects NAME=V1,V2,..., got {text!r}")
        return key.strip(), values(rest)

    convert.__name__ = "grid"
    return convert


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}={_shown(v)}" for k, v in value.items()) or "none"
    return str(value)


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    title: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add a flag for every field of ``cls`` not in ``skip``.

    ``defaults``: the values shown as defaults in ``--help`` where they differ from
    the dataclass's own (e.g. the chosen preset's values).
    """
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if field.name in skip or not meta.get("cli", True):
            continue
        annotation = _strip_optional(hints[field.name])
        origin = typing.get_origin(annotation)
        default = (defaults or {}).get(field.name, _default_of(field))
        text = meta.get("help") or field.name.replace("_", " ")
        if meta.get("required"):
            text += " (required)"
        elif default is None:
            text += f" (default: {meta.get('default_text') or 'none'})"
        elif annotation is not bool:
            text += f" (default: {_shown(default)})"
        else:
            text += f" (default: {'on' if default else 'off'})"
        dest = f"{cls.__name__}.{field.name}"
        common = dict(dest=dest, default=None, help=text.replace("%", "%%"))
        if meta.get("required"):
            common["required"] = True
        if annotation is bool:
            group.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction, **common)
        elif origin is tuple:
            kind = _scalar(typing.get_args(annotation)[0])
            group.add_argument(flag_name(field.name), type=_tuple_converter(kind, field.name),
                               metavar=meta.get("metavar") or f"{kind.__name__.upper()}[,...]", **common)
        elif origin is list:
            kind = _scalar(typing.get_args(annotation)[0])
            group.add_argument(flag_name(field.name), type=_converter(kind, field.name), action="append",
                               metavar=meta.get("metavar") or kind.__name__.upper(), **common)
        elif origin is dict:
            value_type = typing.get_args(annotation)[1]
            kind = _scalar(typing.get_args(value_type)[0])
            group.add_argument(flag_name(field.name), type=_grid_converter(kind, field.name), action="append",
                               metavar=meta.get("metavar") or "NAME=V1,V2", **common)
        else:
            kind = _scalar(annotation)
            group.add_argument(flag_name(field.name), type=_converter(kind, field.name),
                               metavar=meta.get("metavar") or kind.__name__.upper(), **common)


def overrides(args: argparse.Namespace, cls: type, check: bool = True) -> dict[str, Any]:
    """The fields of ``cls`` the user set on the command line (repeated grids as a dict); with ``check``,
    non-finite numbers and non-UTF-8 text are refused (:func:`check_typed_value`)."""
    prefix = f"{cls.__name__}."
    values = {}
    for key, value in vars(args).items():
        if key.startswith(prefix) and value is not None:
            name = key[len(prefix):]
            if check:
                check_typed_value(name, value)
            is_grid = isinstance(value, list) and value and isinstance(value[0], tuple)
            values[name] = dict(value) if is_grid else value
    return values


def build(cls: type, base: dict[str, Any], args: argparse.Namespace):
    """``cls(**base)`` with the command-line overrides applied and validated."""
    given = overrides(args, cls, check=False)
    try:
        built = cls(**{**base, **given})  # the config's own message first, where it checks the value itself
    except TypeError as exc:
        raise RdepthError(f"bad {cls.__name__}: {exc}") from None
    for name, value in given.items():  # then what no field means, for every flag of every command
        check_typed_value(name, value)
    return built

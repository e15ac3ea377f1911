"""Config fields that carry their own command-line help and bounds (torch-free).

Every config dataclass declares its fields with :func:`option`, so the help text,
the default, the flag and the values allowed live in one place; :mod:`rdepth.cli.options`
turns the fields into flags, and :func:`check_fields` checks every declared bound and
choice of a config in one pass. Nothing else writes a default, a help string or a
simple bound twice; a config's ``__post_init__`` keeps only the rules between fields.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

from rdepth.errors import RdepthError


def option(default: Any = dataclasses.MISSING, help: str = "", *, required: bool = False,
           default_text: str | None = None, metavar: str | None = None, cli: bool = True,
           bounds: str | None = None, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field with its command-line help.

    ``required``: the flag must be given on the command line (the field keeps a
    default for the Python API). ``default_text``: how to show a ``None``
    default in ``--help`` (e.g. "the model's block size"). ``cli=False``: no flag.
    ``bounds``: the interval the value (or each item of a tuple) must lie in, written
    as in mathematics, e.g. ``"[1, inf)"``, ``"(0, 1)"``, ``"[0, 4096]"``; an ``int``
    field takes integers only (never a bool). ``choices``: the values allowed. A field
    whose default is None may stay None. :func:`check_fields` applies both.
    """
    metadata = {"help": help, "required": required, "default_text": default_text, "metavar": metavar, "cli": cli,
                "bounds": None if bounds is None else Interval.parse(bounds),
                "choices": None if choices is None else tuple(choices)}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (an integer or a float, NumPy's too), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Interval:
    """``[low, high]`` with either end open or infinite: the bounds of one field."""

    low: int | float
    high: int | float
    low_open: bool
    high_open: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> Interval:
        try:  # integers kept exact: 2**63 - 1 as a float would admit 2**63
            low, high = (int(part) if part.strip().lstrip("-").isdigit() else float(part)
                         for part in text.strip()[1:-1].split(","))
        except ValueError:
            raise ValueError(f"bounds {text!r}: expected an interval such as '[1, inf)'") from None
        if text[0] not in "[(" or text[-1] not in "])" or not low <= high:
            raise ValueError(f"bounds {text!r}: expected an interval such as '[1, inf)'")
        return cls(low, high, text[0] == "(", text[-1] == ")", text.replace(" ", "").replace(",", ", "))

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)  # NaN is in no interval

    def describe(self, integer: bool, items: bool) -> str:
        """What a value must be, as the error says it: 'a positive integer', 'an integer in [0, 4096]'."""
        unbounded = math.isinf(self.high)
        if integer:
            if unbounded and self.low == 1 and not self.low_open:
                return "positive integers" if items else "a positive integer"
            if unbounded and not self.low_open:
                return f"integers >= {self.low:g}" if items else f"an integer >= {self.low:g}"
            return f"integers in {self.text}" if items else f"an integer in {self.text}"
        if unbounded:
            sign = ">" if self.low_open else ">="
            if items:
                return "positive numbers" if (self.low, self.low_open) == (0, True) else f"numbers {sign} {self.low:g}"
            return f"a finite number {sign} {self.low:g}" if self.high_open else f"{sign} {self.low:g}"
        return f"numbers in {self.text}" if items else f"a number in {self.text}"


def check_fields(config: Any, owner: str) -> None:
    """Check every field of the dataclass ``config`` that declares ``bounds`` or ``choices`` (:func:`option`):
    an :class:`~rdepth.errors.RdepthError` naming the first field out of them, as
    ``"{owner}: {field} must be ..., got {value!r}"``. None passes where the field's default is None."""
    for field in dataclasses.fields(config):
        bounds, choices = field.metadata.get("bounds"), field.metadata.get("choices")
        if bounds is None and choices is None:
            continue
        value = getattr(config, field.name)
        if value is None and field.default is None:
            continue
        if choices is not None and value not in choices:
            raise RdepthError(f"{owner}: {field.name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        if bounds is None:
            continue
        annotation = str(field.type)
        items = annotation.startswith("tuple") or annotation.startswith("list")
        integer = "int" in annotation and "float" not in annotation
        accepts = is_int if integer else is_number
        values = tuple(value) if items and isinstance(value, (tuple, list)) else None if items else (value,)
        if not values or not all(accepts(v) and v in bounds for v in values):
            raise RdepthError(f"{owner}: {field.name} must be {bounds.describe(integer, items)}, got {value!r}")

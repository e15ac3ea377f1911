"""Bounds and choices declared on a config field (rdepth.fields.option), checked by one function."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from rdepth.errors import RdepthError
from rdepth.fields import Interval, check_fields, is_int, option


@dataclass
class Probe:
    count: int = option(1, "a positive count", bounds="[1, inf)")
    seed: int = option(0, "a seed", bounds=f"[0, {2**63})")
    share: float = option(0.5, "an open share", bounds="(0, 1)")
    rate: float | None = option(None, "optional, above zero", bounds="(0, inf)")
    budgets: tuple[int, ...] = option((1, 2), "loop budgets", bounds="[1, 1024]")
    mode: str = option("a", "a mode", choices=("a", "b"))


@pytest.mark.parametrize("field, value, message", [
    ("count", 0, "probe: count must be a positive integer, got 0"),
    ("count", True, "probe: count must be a positive integer, got True"),
    ("count", 2.0, "probe: count must be a positive integer, got 2.0"),
    ("seed", 2**63, f"probe: seed must be an integer in [0, {2**63}), got {2**63}"),
    ("share", 1, "probe: share must be a number in (0, 1), got 1"),
    ("share", float("nan"), "probe: share must be a number in (0, 1), got nan"),
    ("rate", 0.0, "probe: rate must be a finite number > 0, got 0.0"),
    ("budgets", (), "probe: budgets must be integers in [1, 1024], got ()"),
    ("budgets", (1, 1025), "probe: budgets must be integers in [1, 1024], got (1, 1025)"),
    ("mode", "c", "probe: mode must be one of a, b, got 'c'"),
])
def test_a_value_out_of_its_field_is_named(field, value, message):
    with pytest.raises(RdepthError) as error:
        check_fields(Probe(**{field: value}), "probe")
    assert str(error.value) == message


def test_values_inside_pass():
    check_fields(Probe(), "probe")  # the defaults; rate None: optional
    check_fields(Probe(count=np.int64(3), seed=2**63 - 1, share=1e-9, rate=3, budgets=[1024], mode="b"), "probe")


def test_intervals_and_integers():
    closed, open_ = Interval.parse("[0, 4096]"), Interval.parse("(0, 1)")
    assert 0 in closed and 4096 in closed and 4097 not in closed
    assert 0 not in open_ and 0.5 in open_ and 1 not in open_
    assert is_int(np.int32(1)) and not is_int(True) and not is_int(1.0)
    with pytest.raises(ValueError):
        Interval.parse("1, 2")

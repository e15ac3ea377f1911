"""Exit policies by name: the registry, with every built-in rule registered.

The rules register themselves with ``@register_policy`` when
:mod:`rdepth.exits.policies` is imported; importing this module does that, so a
lookup here always sees the built-in rules (and any registered since).
"""

from __future__ import annotations

from typing import Any

import rdepth.exits.policies  # noqa: F401  (registers the built-in rules)
from rdepth.errors import RdepthError
from rdepth.exits.base import POLICIES, Decode, ExitPolicy


def get_policy_class(name: str) -> type[ExitPolicy]:
    """Look a policy up by name; an unknown name is a user error."""
    try:
        return POLICIES[name]
    except KeyError:
        raise RdepthError(f"unknown exit policy {name!r} (choose from {', '.join(POLICIES)})") from None


def make_policy(
    name: str, tau: float | None = None, k_max: int = 32, decode: Decode | None = None, **options: Any
) -> ExitPolicy:
    """Build a policy by name: ``make_policy("acceleration", tau=1e-3, k_max=12)``."""
    return get_policy_class(name)(tau=tau, k_max=k_max, decode=decode, **options)


def sweepable_policies() -> tuple[str, ...]:
    """Every registered policy except ``fixed`` (the sweep's baseline, always measured) and trained ones."""
    return tuple(name for name, cls in POLICIES.items() if name != "fixed" and not cls.trained)

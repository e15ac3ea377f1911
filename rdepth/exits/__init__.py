"""Early exit from recurrence loops: exit policies, replay on recorded iterates,
a model loop controller, and (in :mod:`rdepth.exits.sweep`) the latency-quality sweep."""

from rdepth.exits import policies as _policies  # noqa: F401  (registers the policies)
from rdepth.exits.base import POLICIES, ExitPolicy, get_policy_class, make_policy, register_policy
from rdepth.exits.controller import PolicyController
from rdepth.exits.replay import drive_recorded, replay

__all__ = [
    "POLICIES",
    "ExitPolicy",
    "PolicyController",
    "drive_recorded",
    "get_policy_class",
    "make_policy",
    "register_policy",
    "replay",
]

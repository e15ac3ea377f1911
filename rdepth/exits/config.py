"""Settings shared by every command that runs exit rules (torch-free at import): the per-group step
caps (``k_max``) and how decoded rules read a state. The sweep's and the calibration's own settings
live in :mod:`rdepth.sweep.config` and :mod:`rdepth.calibrate.config`.
"""

from __future__ import annotations

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError

# How decoded rules (kl, entropy_diff, argmax_stable) read a group's state; see rdepth.exits.decode.
DECODE_MODES = ("head", "rest")


def checked_k_max(command: str, k_max) -> tuple[int, ...] | None:
    """``k_max`` as a tuple of integers in 1..MAX_LOOPS (None stays None); a one-line error otherwise."""
    if k_max is None:
        return None
    k_max = tuple(int(k) for k in k_max)
    if not k_max or any(not 1 <= k <= MAX_LOOPS for k in k_max):
        raise RdepthError(f"{command}: k_max must be integers in 1..{MAX_LOOPS}, got {k_max}")
    return k_max


def resolve_k_max(command: str, k_max: tuple[int, ...] | None, n_groups: int,
                  eval_loops: tuple[int, ...]) -> tuple[int, ...]:
    """Per-group step caps: ``k_max`` as given (one value for every group, or one per group), else
    twice the model's eval loop counts."""
    if k_max is None:
        return tuple(2 * int(k) for k in eval_loops)
    if len(k_max) == 1:
        return k_max * n_groups
    if len(k_max) != n_groups:
        raise RdepthError(f"{command}: {len(k_max)} k_max values for a model with {n_groups} groups")
    return k_max


# Flags of sweep and calibrate that only some exit rules read: name -> (which rules, does a rule read it)
_RULE_FLAGS = {
    "kl_direction": ("the kl policy", lambda cls: cls.name == "kl"),
    "kl_prior": ("the kl policy", lambda cls: cls.name == "kl"),
    "decode": ("the decoded policies (those reading the head: kl, entropy_diff, argmax_stable, ...)",
               lambda cls: cls.needs_decode),
    "decode_loops": ("the decoded policies (those reading the head: kl, entropy_diff, argmax_stable, ...)",
                     lambda cls: cls.needs_decode),
}


def changed_fields(config) -> set[str]:
    """The names of ``config``'s dataclass fields whose values differ from their defaults (what a caller of
    the Python API set; the command line passes the flags it was given instead)."""
    import dataclasses

    changed = set()
    for field in dataclasses.fields(config):
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        if getattr(config, field.name) != default:
            changed.add(field.name)
    return changed


def check_rule_flags_apply(command: str, given, policies, *, decode: str = "head", profile: bool = False) -> None:
    """A one-line error for a flag in ``given`` (field names) that none of ``policies`` reads (``--kl-prior``
    without kl, ``--decode`` without a decoded rule), and for ``--decode-loops`` without ``--decode rest``:
    a flag that does not apply is never silently ignored. ``profile``: an exit profile is measured too
    (its rule may read ``--decode``)."""
    from rdepth.exits.registry import get_policy_class

    classes = [get_policy_class(name) for name in policies]
    for name in sorted(set(given) & set(_RULE_FLAGS)):
        users, reads = _RULE_FLAGS[name]
        flag = "--" + name.replace("_", "-")
        if not any(reads(cls) for cls in classes) and not (profile and name.startswith("decode")):
            raise RdepthError(f"{command}: {flag} applies to {users}; the policies {', '.join(policies)} do not "
                              "read it: drop it")
        if name == "decode_loops" and decode != "rest":
            raise RdepthError(f"{command}: --decode-loops applies with --decode rest only: drop it or pass --decode rest")

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

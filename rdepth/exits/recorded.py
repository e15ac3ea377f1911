"""Apply an exit policy to recorded loop iterates.

:func:`replay` drives a :class:`~rdepth.exits.controller.PolicyController`
step by step over recorded states exactly as the model's packed loop does
(the active rows' previous and new states, the rows that are done removed),
so replaying the iterates an observer recorded during an online run with
exits gives that run's exits.
"""

from __future__ import annotations

from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import Decode, ExitPolicy
from rdepth.exits.controller import PolicyController
from rdepth.exits.registry import make_policy
from rdepth.model.loop import LoopRows


def replay(
    policy: str | ExitPolicy,
    states: torch.Tensor,
    tau: float | None = None,
    *,
    k_max: int | None = None,
    decode: Decode | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exits of ``policy`` on recorded iterates.

    Args:
        policy: a registered name (built with ``tau``, ``k_max`` and
            ``options``) or a policy object (then those must be left out).
        states: ``[K+1, N, d]``: ``states[0]`` is ``s0`` and ``states[k]`` the
            state after loop step k, for N tokens.
        k_max: step cap for a named policy; default K.
        decode: ``state [A, d] -> logits [A, V]`` for decoded rules.

    Returns:
        ``(used, computed)``, int64 ``[N]``: the index into ``states`` of the
        state each token hands on, and the number of loop steps it computed.
    """
    if states.dim() != 3 or states.shape[0] < 2:
        raise RdepthError(f"replay needs states [K+1, N, d] with K >= 1, got shape {tuple(states.shape)}")
    recorded = states.shape[0] - 1
    if isinstance(policy, str):
        policy = make_policy(policy, tau=tau, k_max=recorded if k_max is None else k_max, decode=decode, **options)
    elif tau is not None or k_max is not None or options:
        raise RdepthError("replay: give tau, k_max and options only with a policy name, not a policy object")
    controller = PolicyController([policy], decode=decode)
    return drive_recorded(controller, 0, states)


def drive_recorded(
    controller: PolicyController, group: int, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``controller`` for ``group`` over recorded ``states`` ``[K+1, N, d]``.

    Uses the model's own loop bookkeeping (:class:`rdepth.model.loop.LoopRows`);
    returns ``(used, computed)`` int64 ``[N]``. A token still looping after the
    last recorded step is an error.
    """
    loop = LoopRows(controller, group, states[0])

    def recorded(prev: torch.Tensor, step: int, rows: torch.Tensor) -> torch.Tensor:
        if step >= states.shape[0]:
            raise RdepthError(
                f"replay: {rows.numel()} token(s) still loop after the {states.shape[0] - 1} recorded "
                f"steps (the policy allows {loop.max_steps})"
            )
        return states[step, rows]

    loop.run(states[0], recorded)
    return loop.used, loop.computed

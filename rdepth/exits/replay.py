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
from rdepth.exits.base import Decode, ExitPolicy, make_policy
from rdepth.exits.controller import PolicyController


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

    Mirrors the model's packed loop; returns ``(used, computed)`` int64 ``[N]``.
    A token still looping after the last recorded step is an error.
    """
    n_rows = states.shape[1]
    device = states.device
    used = torch.zeros(n_rows, dtype=torch.long, device=device)
    computed = torch.zeros(n_rows, dtype=torch.long, device=device)
    rows = torch.arange(n_rows, device=device)
    controller.begin(group, states[0])
    max_steps = controller.max_steps(group)
    for step in range(1, max_steps + 1):
        if step >= states.shape[0]:
            raise RdepthError(
                f"replay: {rows.numel()} token(s) still loop after the {states.shape[0] - 1} recorded "
                f"steps (the policy allows {max_steps})"
            )
        prev = states[step - 1, rows]
        new = states[step, rows]
        done, _, used_now = controller.after_step(group, step, rows, prev, new)
        if step == max_steps:
            done = torch.ones_like(done)
        finished = rows[done]
        computed[finished] = step
        used[finished] = used_now[done]
        rows = rows[~done]
        if rows.numel() == 0:
            break
    return used, computed

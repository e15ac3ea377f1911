"""The one routine that runs a group's loop under a loop controller, and its bookkeeping.

Every driver of a group's loop under a controller calls :class:`LoopRows`: the model's packed
forward under a controller (:class:`rdepth.model.walk.PackedWalk`), the replay of recorded
iterates (:func:`rdepth.exits.recorded.drive_recorded`) and the decoder's fixed and exit paths
(:class:`rdepth.model.decoder.Decoder`). A loop without a controller (the dense forward, the shifted
warm start, the decoder's lock-step prompt) runs :func:`run_fixed`. After every step the controller sees the rows' previous and
new states, and :func:`stop_and_hand_on` (the only place that does) records which rows stop, the state
and iterate index each hands on and the steps each computed, so a replay makes exactly the decisions
an online run makes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.model.control import LoopController

# step_fn(state [A, d], step, rows [A]) -> new [A, d]: one loop step of the rows ``rows``.
StepFn = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


def run_fixed(state: torch.Tensor, steps: int, step_fn: Callable[[torch.Tensor, int], torch.Tensor],
              observe: Callable[[int, torch.Tensor], None] | None = None, first_grad_step: int = 1) -> torch.Tensor:
    """A group's loop at a fixed budget: every row runs ``steps`` steps of ``step_fn(state, step)`` (no row
    stops before the last, so there is nothing to keep per row); ``observe(step, state)`` after each;
    gradients (where enabled) from step ``first_grad_step`` on (truncated backprop). Returns the last
    iterate, shaped as ``state``."""
    grad_on = torch.is_grad_enabled()
    for step in range(1, steps + 1):
        with torch.set_grad_enabled(grad_on and step >= first_grad_step):
            state = step_fn(state, step)
        if observe is not None:
            observe(step, state)
    return state


def stop_and_hand_on(step: int, last: int, active: torch.Tensor, done: torch.Tensor, handoff: torch.Tensor,
                     used_now: torch.Tensor, handed: torch.Tensor, used: torch.Tensor,
                     computed: torch.Tensor) -> None:
    """The bookkeeping after loop step ``step`` of at most ``last``, in place over all N rows, predicated
    (no host read): every ``active`` row counts the step in ``computed`` ``[N]``; the rows stopping now
    (``active & done``; every active row at ``last``) hand on ``handoff`` ``[N, d]`` into ``handed`` and its
    iterate index ``used_now`` ``[N]`` into ``used``; ``active`` ``[N]`` bool loses the rows ``done``."""
    stopping = active if step == last else active & done
    if handoff.dtype != handed.dtype:  # (a call even when equal: skipped on the hot path)
        handoff = handoff.to(handed.dtype)
    handed.copy_(torch.where(stopping[:, None], handoff, handed))  # (no out=: autograd)
    torch.where(stopping, used_now, used, out=used)
    computed.masked_fill_(active, step)
    active.masked_fill_(done, False)


def rows_leaving(rows: np.ndarray, steps: np.ndarray, stopping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row-indexed bookkeeping after a loop step of rows that loop at their own steps (continuous depth
    batching, :mod:`rdepth.engine`), on the host: of the slots ``rows`` ``[A]`` at steps ``steps`` ``[A]`` (the
    step each just computed), those ``stopping`` ``[A]`` bool leave; returns them and the steps each computed
    (what :func:`stop_and_hand_on` records as ``computed`` for rows in lock-step)."""
    return rows[stopping], steps[stopping]


def next_steps(steps: torch.Tensor, stopping: torch.Tensor) -> torch.Tensor:
    """The step each row computes next, on the device, predicated: one on, or 1 where it stopped (its next loop,
    in the next group or at the next position, starts there)."""
    return torch.where(stopping, 1, steps + 1)


class LoopRows:
    """Which rows of a group still loop, and what each finished row handed on.

    ``state`` ``[N, d]``: the initial states of all N rows. After the loop: ``handed_on`` ``[N, d]`` the
    state each row passes to the next stage, ``computed`` ``[N]`` the loop steps it ran, ``used`` ``[N]``
    the index (0..computed) of the iterate it handed on, ``active`` ``[N]`` the rows still looping.
    ``buffers`` (``handed_on, computed, used, active``): tensors to keep them in, in place (the
    decoder's static buffers); default: fresh ones.

    Two ways to step: :meth:`run` steps the active rows only (packed: they are gathered, one host read
    per step; the loop ends when none is left), :meth:`step_all` steps every row, predicated (a stopped
    row keeps its hand-off; no host read).
    """

    def __init__(self, controller: LoopController, group: int, state: torch.Tensor,
                 buffers: tuple[torch.Tensor, ...] | None = None):
        self.controller = controller
        self.group = group
        self.max_steps = controller.max_steps(group)
        if self.max_steps < 1:
            raise RdepthError(f"loop controller allows {self.max_steps} steps for group {group}; need >= 1")
        if buffers is None:
            n_rows, device = state.shape[0], state.device
            buffers = (torch.empty_like(state), torch.zeros(n_rows, dtype=torch.long, device=device),
                       torch.zeros(n_rows, dtype=torch.long, device=device),
                       torch.ones(n_rows, dtype=torch.bool, device=device))
        self.handed_on, self.computed, self.used, self.active = buffers
        self.all_rows = torch.arange(state.shape[0], device=state.device)
        self.begin(state)

    def begin(self, state: torch.Tensor) -> None:
        """Start the loop from ``state`` ``[N, d]`` (every row looping; a row that stops at once hands
        on its newest iterate)."""
        self.active.fill_(True)
        self.handed_on.copy_(state)
        self.controller.begin(self.group, state)

    def step_all(self, step: int, prev: torch.Tensor, new: torch.Tensor) -> None:
        """Record step ``step`` of every row (``prev``/``new`` ``[N, d]``), predicated on ``active``."""
        done, handoff, used_now = self.controller.after_step(self.group, step, self.all_rows, prev, new)
        stop_and_hand_on(step, self.max_steps, self.active, done, handoff, used_now, self.handed_on,
                         self.used, self.computed)

    def run(self, state: torch.Tensor, step_fn: StepFn, observe: Callable | None = None) -> torch.Tensor:
        """The whole loop on the active rows only: ``step_fn(prev [A, d], step, rows [A])`` per step;
        ``observe(step, state [N, d], active [N])`` after each. Returns the newest iterates ``[N, d]``."""
        rows = self.all_rows
        for step in range(1, self.max_steps + 1):
            prev = state[rows]
            new = step_fn(prev, step, rows)
            state = state.index_copy(0, rows, new.to(state.dtype))
            done, handoff, used_now = self.controller.after_step(self.group, step, rows, prev, new)
            if observe is not None:
                observe(step, state, self.active.clone())
            whole = self.handed_on.index_copy(0, rows, handoff.to(self.handed_on.dtype))
            stop_and_hand_on(step, self.max_steps, self.active, self._spread(rows, done, False), whole,
                             self.used.index_copy(0, rows, used_now), self.handed_on, self.used, self.computed)
            rows = rows[~done]
            if rows.numel() == 0:  # the one host read of a step
                break
        return state

    def _spread(self, rows: torch.Tensor, values: torch.Tensor, fill) -> torch.Tensor:
        """``values`` ``[A]`` of the rows ``rows`` as ``[N]``, ``fill`` elsewhere."""
        return torch.full_like(self.active, fill).index_copy(0, rows, values)

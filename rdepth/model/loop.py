"""Row bookkeeping of one group's loop under a loop controller.

The model's packed loop (:meth:`rdepth.model.RecurrentLM._forward_packed`) and
the replay of recorded iterates (:func:`rdepth.exits.recorded.drive_recorded`)
share this one routine, so a replay makes exactly the decisions an online run
makes: after every step the controller sees the active rows' previous and new
states, the rows it stops hand on the state it names, and they leave the loop.
"""

from __future__ import annotations

import torch

from rdepth.errors import RdepthError
from rdepth.model.control import LoopController


class LoopRows:
    """Which rows of a group still loop, and what each finished row handed on.

    ``state`` ``[N, d]``: the initial states of all N rows. After the loop:
    ``handed_on`` ``[N, d]`` the state each row passes to the next stage,
    ``computed`` ``[N]`` the loop steps it ran, ``used`` ``[N]`` the index
    (0..computed) of the iterate it handed on.
    """

    def __init__(self, controller: LoopController, group: int, state: torch.Tensor):
        self.controller = controller
        self.group = group
        n_rows = state.shape[0]
        device = state.device
        self.rows = torch.arange(n_rows, device=device)  # [A] the rows still looping
        self.handed_on = torch.empty_like(state)
        self.computed = torch.zeros(n_rows, dtype=torch.long, device=device)
        self.used = torch.zeros(n_rows, dtype=torch.long, device=device)
        controller.begin(group, state)
        self.max_steps = controller.max_steps(group)
        if self.max_steps < 1:
            raise RdepthError(f"loop controller allows {self.max_steps} steps for group {group}; need >= 1")

    def steps(self) -> range:
        """Loop steps 1 .. max_steps (stop early when :meth:`finish_step` says so)."""
        return range(1, self.max_steps + 1)

    def finish_step(self, step: int, prev: torch.Tensor, new: torch.Tensor) -> bool:
        """Record step ``step`` of the active rows (``prev``/``new`` ``[A, d]``);
        True when no row loops any more."""
        done, handoff, used_now = self.controller.after_step(self.group, step, self.rows, prev, new)
        if step == self.max_steps:
            done = torch.ones_like(done)
        self.computed[self.rows] = step
        finished = self.rows[done]
        self.handed_on[finished] = handoff[done].to(self.handed_on.dtype)
        self.used[finished] = used_now[done]
        self.rows = self.rows[~done]
        return self.rows.numel() == 0

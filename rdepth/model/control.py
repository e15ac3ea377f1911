"""The loop-controller protocol: who decides when a token leaves a loop.

The model runs a group's loop in lock-step over the tokens still active and,
after every step, asks the controller which of them are done. Exit policies
(:mod:`rdepth.exits`) implement this protocol; :class:`FixedController` is the
trivial one (a set number of steps per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class LoopController(Protocol):
    def max_steps(self, group: int) -> int:
        """Hard cap on loop steps for ``group``; remaining tokens stop there."""

    def begin(self, group: int, state: torch.Tensor) -> None:
        """Called before step 1 with the initial state ``[N, d]`` of all N tokens
        (flattened batch x time rows)."""

    def after_step(
        self,
        group: int,
        step: int,
        rows: torch.Tensor,
        prev: torch.Tensor,
        new: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After loop step ``step`` (1-based) of the active ``rows`` ``[A]``.

        ``prev``/``new`` ``[A, d]`` are their states before and after the step.
        Returns ``(done [A] bool, handoff [A, d], used [A] long)``: which rows
        stop now, the state each passes on, and that state's index among the
        iterates 0..step.
        """

    # Continuous depth batching (rdepth.engine) also calls, on rows that loop at different steps:
    #   begin_rows(group, rows [A], state [A, d]): start these rows' loops, the others going on;
    #   after_steps(group, steps [A] long, values (the distinct steps, host ints), rows, prev, new):
    #   after_step for each row at its own step. FixedController and PolicyController have both.


class FixedController:
    """Every token of group g runs exactly ``counts[g]`` steps."""

    def __init__(self, counts: Sequence[int]):
        self.counts = [int(c) for c in counts]

    def max_steps(self, group: int) -> int:
        return self.counts[group]

    def begin(self, group: int, state: torch.Tensor) -> None:
        pass

    def after_step(self, group, step, rows, prev, new):
        done = torch.full((rows.numel(),), step >= self.counts[group], dtype=torch.bool, device=rows.device)
        used = torch.full_like(rows, step)
        return done, new, used

    def begin_rows(self, group: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        pass

    def after_steps(self, group, steps, values, rows, prev, new):
        return steps >= self.counts[group], new, steps

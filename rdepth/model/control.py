"""The loop-controller protocol: who decides when a token leaves a loop.

The model runs a group's loop in lock-step over the tokens still active and,
after every step, asks the controller which of them are done. Exit policies
(:mod:`rdepth.exits`) implement this protocol; :class:`FixedController` is the
trivial one (a set number of steps per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

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



@runtime_checkable
class RowController(Protocol):
    """A loop controller that serves rows looping at different steps (continuous depth batching,
    :mod:`rdepth.engine`): :class:`FixedController` and the exit rules'
    :class:`~rdepth.exits.controller.PolicyController` implement it (and :class:`LoopController` too)."""

    def max_steps(self, group: int) -> int:
        """Hard cap on loop steps for ``group``."""

    def begin(self, group: int, state: torch.Tensor) -> None:
        """Called once with a state ``[B, d]`` of every slot (the rule's per-row memory allocated)."""

    def begin_rows(self, group: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Start the loops of the rows ``rows`` ``[A]`` from ``state`` ``[A, d]``, the other rows going on."""

    def after_steps(self, group: int, steps: torch.Tensor, values: Sequence[int], rows: torch.Tensor,
                    prev: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`LoopController.after_step` for each row of ``rows`` ``[A]`` at its own step ``steps`` ``[A]``
        (``values``: the distinct steps among them, host ints)."""


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

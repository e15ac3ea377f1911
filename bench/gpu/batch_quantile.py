"""The batch-quantile exit: a group's loop stops for the whole batch once few enough rows still loop.

Opt-in and batch-dependent by design (rows then depend on their batch: no batch-of-one equality); the
GPU benchmarks time it against per-row exits (``bench/batched_exits.py``).
"""

from __future__ import annotations

import math

import torch

from rdepth.errors import RdepthError
from rdepth.model.control import LoopController


class BatchQuantile:
    """``inner``'s exits, and when at most ``floor((1 - quantile) * N)`` of a group's N rows would loop on
    after a step, those stragglers stop too, handing on their newest state (used index = the step). On the
    device, no host read; ``quantile`` 1.0 is ``inner`` itself."""

    def __init__(self, inner: LoopController, quantile: float):
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 1:
            raise RdepthError(f"decoder: batch_quantile must be in (0, 1], got {quantile!r}")
        self.inner = inner
        self.quantile = float(quantile)
        self._active: dict[int, torch.Tensor] = {}  # per group [N]: the rows still looping
        self._stragglers = 0

    def max_steps(self, group: int) -> int:
        return self.inner.max_steps(group)

    def begin(self, group: int, state: torch.Tensor) -> None:
        self.inner.begin(group, state)
        rows = state.shape[0]
        self._stragglers = int(math.floor((1 - self.quantile) * rows + 1e-9))
        active = self._active.get(group)
        if active is None or active.shape[0] != rows:
            active = self._active[group] = torch.ones(rows, dtype=torch.bool, device=state.device)
        active.fill_(True)

    def after_step(self, group, step, rows, prev, new):
        done, handoff, used_now = self.inner.after_step(group, step, rows, prev, new)
        if self._stragglers == 0:  # only when none loops on: the rule's decisions as they are
            return done, handoff, used_now
        active = self._active[group].index_select(0, rows)
        still = active & ~done  # [A]: rows the rule keeps looping
        cut = still & (still.sum() <= self._stragglers)  # all of them, or none
        handoff = torch.where(cut[:, None], new.to(handoff.dtype), handoff)
        used_now = torch.where(cut, torch.full_like(used_now, step), used_now)
        done = done | cut
        self._active[group].index_copy_(0, rows, active & ~done)
        return done, handoff, used_now

"""rdepth's engine (:mod:`rdepth.engine`) over a looped ``transformers`` model: many requests at once, through
its adapter.

:class:`LoopedEngine` is the engine's client side and host scheduler (:class:`~rdepth.engine.engine.EngineBase`,
:class:`~rdepth.engine.scheduler.Scheduler`: slots, the queue, admission, retirement, token choice, the per-token
listener) with a tick of its own, :class:`LoopedTick`. Each tick every occupied slot enters one token (its
prompt's next, or the one the scheduler chose) at its own position and runs the whole position, every loop, in
one tick; every slot is read out every tick.

* An adapter whose ``embed`` takes a :class:`~rdepth.looped.slot_cache.LoopedSlotCache` (HRM-Text) runs every slot in
  **one call**, each row at its own position: at a fixed budget (:func:`rdepth.looped.protocol.forward`), or
  with per-token exits of its loops (:func:`rdepth.looped.exits.decode_position`: a rule on the L loop of each H
  step and on the H loop, the latest-KV rule for the skipped steps' slots, each row's rule memory its own).
* Any other adapter (Inkling-2, whose cache also holds short convolutions' rolling states) keeps a cache of
  the model's own per slot and runs **a call per slot**, at a fixed budget: exact, not batched.

A row's tokens are those of the adapter's batch-1 decode (:func:`~rdepth.looped.protocol.greedy`, or
:func:`~rdepth.looped.exits.decode_with_exits` with the same rules), whatever shares its batch
(``tests/test_looped_engine.py``). The scheduler's groups are the adapter's loops, outermost first; a loop's
steps per position are summed over the runs of it (HRM-Text's L: over the H steps), so its cap is its budget
times those of the loops around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from rdepth.engine.engine import EngineBase
from rdepth.engine.scheduler import Scheduler
from rdepth.engine.tick import TickInput, TickOutput
from rdepth.errors import RdepthError
from rdepth.exits.base import ExitPolicy
from rdepth.looped.protocol import LoopedAdapter, forward
from rdepth.looped.slot_cache import LoopedSlotCache


def loop_totals(adapter: LoopedAdapter, budgets: dict[str, int]) -> list[int]:
    """Each loop's steps per position (outermost first): its budget times the budgets of the loops it runs in."""
    outer = {spec.inner: spec.name for spec in adapter.loops if spec.inner is not None}
    totals: dict[str, int] = {}
    for spec in adapter.loops:
        parent = outer.get(spec.name)
        totals[spec.name] = budgets[spec.name] * (totals[parent] if parent is not None else 1)
    return [totals[spec.name] for spec in adapter.loops]


class LoopedTick:
    """One position for every occupied slot of a :class:`LoopedEngine` (see the module)."""

    name = "looped"

    def __init__(self, adapter: LoopedAdapter, batch: int, capacity: int, budgets: dict[str, int],
                 low: ExitPolicy | None, high: ExitPolicy | None, device: torch.device):
        self.adapter, self.budgets, self.low, self.high, self.device = adapter, budgets, low, high, device
        self.exits = low is not None or high is not None
        self.fixed_steps = np.asarray(loop_totals(adapter, budgets), dtype=np.int64)
        self.cache = LoopedSlotCache(batch, capacity) if adapter.slot_cache else None
        self.caches: list = [None] * batch  # a cache of the model's own per slot (an adapter without slot caches)

    def __call__(self, tick_input: TickInput) -> TickOutput:
        for row in tick_input.retired.tolist():
            self.caches[row] = None  # (a slot's own cache freed with its request)
        for row, _ in tick_input.admitted:
            if self.cache is not None:
                self.cache.clear(row)  # (a former request's entries past the new one's position)
            else:
                self.caches[row] = self.adapter.new_cache()
        rows = tick_input.entering
        groups = len(self.fixed_steps)
        if not rows.size:
            return TickOutput.nothing(groups, [0] * groups)
        tokens = torch.as_tensor(tick_input.tokens, device=self.device)[:, None]
        if self.cache is None:
            logits = torch.cat([forward(self.adapter, tokens[i:i + 1], self.caches[row], self.budgets)[:, -1]
                                for i, row in enumerate(rows.tolist())])
            steps = np.tile(self.fixed_steps, (rows.size, 1))
        else:
            self.cache.select(torch.as_tensor(rows, device=self.device),
                              torch.as_tensor(tick_input.positions, device=self.device))
            logits, steps = self._batched(tokens)
        finite = torch.isfinite(logits).all(dim=-1)
        greedy = torch.where(finite, logits.argmax(dim=-1), -1).cpu().numpy()
        return TickOutput(rows, greedy, steps, logits, np.arange(rows.size), steps.sum(axis=0).tolist())

    def _batched(self, tokens: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        if not self.exits:
            logits = forward(self.adapter, tokens, self.cache, self.budgets)[:, -1]
            return logits, np.tile(self.fixed_steps, (tokens.shape[0], 1))
        from rdepth.looped.exits import decode_position

        logits, low_steps, high_steps = decode_position(self.adapter, tokens, self.cache, self.low, self.high)
        return logits, torch.stack([high_steps, low_steps.sum(dim=1)], dim=1).cpu().numpy()

    def kv_bytes_per_token(self) -> int:
        if self.cache is not None:
            return self.cache.bytes_per_token()
        return 0  # (a per-slot cache of the model's own: its layout is the model's)


class LoopedEngine(EngineBase):
    """Continuous batching over ``batch_size`` slots of a looped adapter's model (see the module).

    Args:
        adapter: the looped model (:func:`rdepth.looped.load.open_looped`), set to eval mode.
        batch_size: slots (requests decoded together).
        budgets: each loop's steps (default: the model's own), or
        low, high: HRM-Text's exit policies for the L loop (a latent rule) and the H loop, each at its loop's
            own budget (None: that loop runs its budget).
        capacity: positions each slot holds (default: the model's ``max_position_embeddings``).
        clock, listener: as :class:`~rdepth.engine.engine.Engine`'s.
    """

    def __init__(self, adapter: LoopedAdapter, batch_size: int, *, budgets: dict[str, int] | None = None,
                 low: ExitPolicy | None = None, high: ExitPolicy | None = None, capacity: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, listener: Callable[..., None] | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RdepthError(f"engine: batch_size must be an integer >= 1, got {batch_size!r}")
        context = int(getattr(adapter.model.config, "max_position_embeddings", 0) or 0)
        capacity = capacity or context
        if context and not 1 <= capacity <= context:
            raise RdepthError(f"engine: capacity must be 1..{context} (the model's context), got {capacity}")
        if capacity < 1:
            raise RdepthError("engine: the model's config names no context length: give the capacity")
        steps = adapter.budgets(budgets)
        exits = low is not None or high is not None
        if exits:
            self._check_exits(adapter, budgets, low, high)
        self.adapter, self.budgets = adapter, steps
        self.loops = [spec.name for spec in adapter.loops]
        self.k_max = loop_totals(adapter, steps)
        adapter.model.eval()
        device = next(adapter.model.parameters()).device
        scheduler = Scheduler(batch_size, capacity, len(self.loops), self.k_max, not exits, device, clock, listener)
        super().__init__(scheduler, LoopedTick(adapter, batch_size, capacity, steps, low, high, device), batch_size,
                         capacity)

    @staticmethod
    def _check_exits(adapter, budgets, low, high) -> None:
        from rdepth.looped.exits import check_policies

        if not adapter.slot_cache or [spec.name for spec in adapter.loops] != ["H", "L"]:
            raise RdepthError(f"engine: per-token exits are offered for HRM-Text only; {adapter.model_type}'s loop "
                              "runs its budget (see docs/ecosystem.md)")
        if budgets:
            raise RdepthError("engine: exit rules run each loop up to its own budget; give budgets or rules, not both")
        check_policies(adapter, low, high, "engine: ")

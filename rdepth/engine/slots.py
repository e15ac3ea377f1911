"""The engine's key/value cache: one row per batch slot, each row at its own position and loop step.

The storage is the model's :class:`~rdepth.model.kv.KVCache` (one ``[B, nh, S, hs]`` tensor per
single-pass layer, ``[K, B, nh, S, hs]`` per looped layer: slot ``k - 1`` holds what loop step k attends
to). What differs from the lock-step decoder is who reads what: in one batched call, row b writes its
new key at its own position ``p_b`` and, in a loop, into its own step's slot ``k_b``, and attends to the
first ``p_b + 1`` keys of that slot (the mask does the rest). :class:`CallStore` is the store a layer
sees for one such call (``update``, as every store of :mod:`rdepth.model.kv`).

Two layouts (:data:`KV_LAYOUTS`, one class each):

* ``exact`` (the default): K slots per looped layer, written *through*: a token's key at loop step k goes
  into slots k..K, so when it leaves its loop at step c the slots after c already hold step c's key (the
  one decoder's latest-KV rule, :meth:`~rdepth.model.kv.KVCache.settle`, with nothing to do at the exit),
  and every token computes what the batch-1 decoder computes.
* ``shared``: one slot per looped layer, every step overwriting it, so a later token at step k reads an
  earlier token's *final* key instead of its step-k key. The memory per token no longer grows with the
  loop budget (K times less for looped layers); the outputs change (the model was trained on the exact
  rule), which is why it is never the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from rdepth.model.kv import AttentionContext, KVCache, LatestRows


class ExactLayout:
    """K slots per looped layer, written through (see the module): every token computes what the batch-1
    decoder computes."""

    name: ClassVar[str] = "exact"
    exact: ClassVar[bool] = True  # every token computes what the batch-1 decoder computes

    def kept(self, k_max: Sequence[int]) -> list[int]:
        """The step slots each group keeps, for loop budgets ``k_max``."""
        return list(k_max)

    def looped(self, store: CallStore, tensor: torch.Tensor, new: torch.Tensor, layer: int,
               which: int) -> torch.Tensor:
        """A looped layer's write of ``new`` ``[A, nh, 1, hs]`` into ``tensor`` ``[K, B, nh, S, hs]`` and what
        the rows read, ``[A, nh, span, hs]``."""
        return store._looped(tensor, new, layer, which)


class SharedLayout:
    """One slot per looped layer, every step overwriting it (see the module): memory that does not grow with
    the loop budget, outputs that differ from the trained rule's."""

    name: ClassVar[str] = "shared"
    exact: ClassVar[bool] = False  # a request's first position only (nothing cached to read)

    def kept(self, k_max: Sequence[int]) -> list[int]:
        return [1] * len(k_max)

    def looped(self, store: CallStore, tensor: torch.Tensor, new: torch.Tensor, layer: int,
               which: int) -> torch.Tensor:
        return store._write_read(tensor[0], new)


# The key/value layouts by name: a new layout is one class here (``name``, ``exact``, ``kept``, ``looped``); the
# layout test in tests/test_engine.py runs over this registry (its bytes per token, and exactness where it claims it).
KV_LAYOUTS: dict[str, type] = {layout.name: layout for layout in (ExactLayout, SharedLayout)}


class SlotCache:
    """Keys/values for ``batch`` slots of ``capacity`` positions (``steps``: slots per group)."""

    def __init__(self, cache: KVCache, layout: ExactLayout | SharedLayout, write_through: bool = True):
        self.cache = cache
        self.layout = layout
        # A fixed budget never leaves a loop early, so slot k only ever holds step k: nothing to write through
        self.write_through = write_through
        self.batch = cache.batch_size
        self.capacity = cache.capacity
        # (the context's slot_index is unused on the one-query-per-row path: the rows stand in for it)
        # Row p: which key positions a query at position p reads (causal), shaped (S, 1, 1, S) for SDPA
        where = torch.arange(self.capacity, device=cache.position.device)
        self._masks = (where[None, :] <= where[:, None]).view(self.capacity, 1, 1, self.capacity)
        self._step_views: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, key 0 / value 1, step): a slot

    def step_slot(self, layer: int, which: int, step: int) -> torch.Tensor:
        """Looped layer ``layer``'s keys (``which`` 0) or values (1) of loop step ``step``, ``[B, nh, S, hs]``
        (a view, made once)."""
        key = (layer, which, step)
        view = self._step_views.get(key)
        if view is None:
            view = self._step_views[key] = self.cache.looped[layer][which][step - 1]
        return view

    def bytes_per_token(self) -> int:
        """Bytes of keys and values one position of one slot takes (every layer, every kept step)."""
        total = 0
        for tensors in (*self.cache.single.values(), *self.cache.looped.values()):
            for tensor in tensors:
                total += tensor.element_size() * tensor.numel() // (self.batch * self.capacity)
        return total

    def context(self, rows: torch.Tensor, host_rows: np.ndarray, positions: np.ndarray, all_rows: bool,
                steps: np.ndarray | None = None) -> AttentionContext:
        """The attention context of one batched call over the slots ``rows`` (on the device; ``host_rows`` the
        same on the host) at ``positions`` ``[A]`` (host), in a loop at ``steps`` ``[A]`` (host, 1-based).
        ``all_rows``: ``rows`` is every slot in order (keys then read as views, without a gather). When
        besides every row is at one position, the call needs no mask and writes along the positions once
        (the lock-step decoder's fast path)."""
        span = int(positions.max()) + 1
        device = rows.device
        same_position = all_rows and int(positions.min()) == span - 1
        positions_t = torch.from_numpy(positions).to(device)
        store = CallStore(self, rows, host_rows, positions, positions_t, span, all_rows, steps, same_position)
        # every slot at the last position read: no mask, as the lock-step decoder; else (A, 1, 1, span)
        mask = None if same_position else self._masks.index_select(0, positions_t).narrow(-1, 0, span)
        return AttentionContext(store, 0, rows, positions_t, rows, 1, rows.shape[0], mask, one_per_row=True)


class CallStore:
    """The store of one batched call (see :meth:`SlotCache.context`): writes each row's keys/values at its
    position (through its step's slot and the later ones) and returns what each row attends to,
    ``[A, nh, span, hs]``."""

    def __init__(self, slots: SlotCache, rows, host_rows, positions, positions_t, span, all_rows, steps,
                 same_position):
        self.slots, self.rows, self.positions, self.span = slots, rows, positions_t, span
        self.all_rows, self.same_position = all_rows, same_position
        self.host = (host_rows, positions, steps)
        self.first = int(positions[0])
        self.same_step = None if steps is None or int(steps.min()) != int(steps.max()) else int(steps[0])
        self._first: LatestRows | None = None  # where the rows' writes go (first looped layer)
        self._single_rows: torch.Tensor | None = None  # where single-pass layers write (first such layer)
        self._flat_read: torch.Tensor | None = None

    def set_step(self, step: int) -> None:
        """Every row on to loop step ``step`` (a fixed budget's loop run to its end in one tick): the same
        rows and positions, so the store is reused instead of made again for each step."""
        host_rows, positions, _ = self.host
        self.host = (host_rows, positions, None)  # every row at ``step``: an array only if an index needs it
        self.same_step = step
        self._first = self._flat_read = None

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.slots.cache
        # keys/values (A, nh, 1, hs); a copy_ casts to the cache's dtype as ``.to`` would (the same rounding)
        if layer in cache.single:
            return tuple(self._write_read(tensor, new)
                         for tensor, new in zip(cache.single[layer], (keys, values), strict=True))
        layout = self.slots.layout
        return tuple(layout.looped(self, tensor, new, layer, which)
                     for which, (tensor, new) in enumerate(zip(cache.looped[layer], (keys, values), strict=True)))

    def _write_read(self, tensor: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Single-pass layer (or one shared slot) ``tensor`` ``[B, nh, S, hs]``: write ``new`` ``[A, nh, 1, hs]``
        at each row's position; read ``[A, nh, span, hs]``."""
        if self.same_position:  # every slot at one position: a view of that column, no index
            tensor.narrow(2, self.first, 1).copy_(new)
            return tensor.narrow(2, 0, self.span)
        if self._single_rows is None:  # (the same for every single-pass layer of the call, keys and values)
            host_rows, positions, _ = self.host
            self._single_rows = torch.from_numpy(
                _head_rows(host_rows, positions, tensor.shape[1], tensor.shape[2])).to(self.rows.device)
        tensor.view(-1, tensor.shape[-1]).index_copy_(0, self._single_rows, new.flatten(0, 2).to(tensor.dtype))
        window = tensor.narrow(2, 0, self.span)
        return window if self.all_rows else window.index_select(0, self.rows)

    def _looped(self, tensor: torch.Tensor, new: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        """Looped layer ``tensor`` ``[K, B, nh, S, hs]``: write ``new`` ``[A, nh, 1, hs]`` at each row's position
        into its step's slot and every later one (the latest-KV rule, :meth:`KVCache.write_latest`); read each
        row's step slot ``[A, nh, span, hs]``."""
        cache, step, through = self.slots.cache, self.same_step, self.slots.write_through
        if self.same_position and step is not None:  # every slot at one position and step: views, no index
            cache.write_latest(tensor, new, step, positions=self.first, through=through)
            return self.slots.step_slot(layer, which, step).narrow(2, 0, self.span)
        if self._first is None:  # (where the writes go: made on the host once per call, every looped layer's)
            host_rows, positions, _ = self.host
            self._first = cache.latest_rows(tensor.shape[0], host_rows, positions, self._host_steps(), through)
        cache.write_latest(tensor, new.squeeze(2), self._first)  # new (A, nh, hs)
        if step is not None:
            window = tensor[step - 1].narrow(2, 0, self.span)
            return window if self.all_rows else window.index_select(0, self.rows)
        if self._flat_read is None:
            host_rows, _, _ = self.host
            batch = self.slots.batch
            self._flat_read = torch.from_numpy((self._host_steps() - 1) * batch + host_rows).to(self.rows.device)
        flat = tensor.view(-1, *tensor.shape[2:])  # (K * B, nh, S, hs)
        return flat.narrow(2, 0, self.span).index_select(0, self._flat_read)

    def _host_steps(self) -> np.ndarray:
        """Each row's loop step on the host ``[A]`` (made here after :meth:`set_step`, which only names it)."""
        host_rows, _, steps = self.host
        return np.full_like(host_rows, self.same_step) if steps is None else steps


def _head_rows(blocks: np.ndarray, positions: np.ndarray, heads: int, capacity: int) -> np.ndarray:
    """For writes into blocks ``blocks`` ``[W]`` (the index over the dims before the heads) at ``positions``
    ``[W]``: the rows of the cache seen as ``[-1, hs]`` that each write's heads go to, ``[W * nh]`` (write by
    write, head by head)."""
    return ((blocks[:, None] * heads + np.arange(heads)) * capacity + positions[:, None]).reshape(-1)

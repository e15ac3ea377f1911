"""The one key/value cache, and the attention context that reads it.

In a looped group every layer runs once per loop step, so a token has one key/value per (layer,
step). A new token at loop step k attends to each earlier token's key/value *of step k*, which is
what a full uncached forward pass computes; a token that left the loop after computing c steps has
no key/value for step k > c, and a later token then sees its *last computed* one, step c (Geiping
et al.'s "latest" lookup).

* :class:`KVCache` holds, for batch B and ``capacity`` positions, one key/value tensor per
  single-pass layer and one per (looped layer, loop step 1..K) of its group, allocated once
  (:meth:`rdepth.model.recurrent.RecurrentLM.new_cache`). The current token's keys are written at a
  *device* position (``index_copy_``), so nothing on the host depends on the data (CUDA graphs).
  Eager decoding sets :attr:`KVCache.limit` to the positions written so far, and the layers then
  read only that prefix. The latest rule is written once, :meth:`KVCache.write_latest` (a row's key of
  step s into the slots of steps s..K), and every store calls it: when a token's loop ends
  (:meth:`KVCache.settle` / :meth:`KVCache.settle_all`: the token's slots of the steps it skipped take
  its last key), or as each step writes (the engine's stores, :class:`ThroughKV`), so that step k reads
  its slot as it is, with no scan of the cache.
* Adapters write into the cache's tensors for the other shapes of a call (each is what a layer's
  ``store.update`` sees): :class:`ChunkKV`, a lock-step pass over several new positions (a prompt, a
  verification); :class:`RowsKV`, packed rows of a teacher-forced pass with exits, all positions in
  lock-step, where one slot per looped layer (its latest key) is exact; :class:`ThroughKV`, packed
  rows of a lock-step pass over new positions under exits, over the cache's step slots (each row's key
  written through to the later steps' slots); :class:`GivenKV`, a loop step's slots handed to a compiled
  piece as tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass
class AttentionContext:
    """Which tokens a packed-row layer call computes and how they attend.

    ``batch_index``/``position`` (each ``[N]``) locate the rows; queries are
    packed into ``[B, slots]`` by ``slot_index``; ``mask`` ``[B, 1, slots, S]``
    allows keys at positions ``<=`` the query's own: boolean (True: read; what
    :meth:`build` makes) or additive in the queries' dtype (0: read, -inf: not;
    what SDPA turns a boolean mask into at every call, so the static decoder
    makes it once per token instead).

    ``one_per_row`` (a host-side flag, set by whoever builds the context, never
    read from the device): the rows are exactly one query per batch row, in
    batch order (N == B, ``slots == 1``, ``batch_index == arange(B)``), as in
    batch decoding. Attention then views the queries as ``(B, nh, 1, hs)``
    instead of packing and unpacking them (the same values, fewer kernels).
    """

    store: KVCache | ChunkKV | RowsKV | GivenKV
    step: int
    batch_index: torch.Tensor
    position: torch.Tensor
    slot_index: torch.Tensor
    slots: int
    n_batch: int
    mask: torch.Tensor
    one_per_row: bool = False
    # (with ``one_per_row``) attention as broadcasts and sums instead of one fused kernel: under
    # ``torch.compile`` the keys' gather from the cache fuses into them (the engine's static tick)
    elementwise: bool = False

    @classmethod
    def build(
        cls, store: KVCache | ChunkKV | RowsKV | GivenKV, step: int, batch_index: torch.Tensor, position: torch.Tensor
    ) -> AttentionContext:
        n_batch = store.batch_size
        device = batch_index.device
        # Slot of each row inside its batch row: rank among rows of the same batch
        # index (rows arrive sorted by batch index, then position).
        counts = torch.bincount(batch_index, minlength=n_batch)
        starts = torch.cumsum(counts, 0) - counts
        slot_index = torch.arange(batch_index.numel(), device=device) - starts[batch_index]
        slots = int(counts.max().item()) if batch_index.numel() else 0
        # Query positions per slot; padding slots look at position 0 only (never NaN).
        query_pos = torch.zeros(n_batch, slots, dtype=torch.long, device=device)
        query_pos[batch_index, slot_index] = position
        key_pos = torch.arange(store.capacity, device=device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
        # Rows sorted by batch index, at most one per batch row and as many as batch rows: one each, in order.
        one_per_row = slots == 1 and batch_index.numel() == n_batch
        return cls(store, step, batch_index, position, slot_index, slots, n_batch, mask, one_per_row)


class LatestRows(NamedTuple):
    """:meth:`KVCache.latest_rows`: the rows of a looped tensor seen as ``[-1, hs]`` that the writes go to
    (``index``), and the new row each takes (``source``)."""

    index: torch.Tensor
    source: torch.Tensor


class KVCache:
    """Keys/values of every layer for one new token per row, at fixed shapes.

    Single-pass layer: ``[B, nh, S, hs]`` (K and V). Looped layer of group g: ``[steps_g, B, nh, S,
    hs]``, slot ``k - 1`` holding what step k attends to (the latest-KV rule already applied, see
    :meth:`settle`). ``position`` ``[1]`` (long, on the device) is where the current token writes.
    :meth:`update` is what the layers call on their ``store``.

    Args:
        n_layer: layers of the model.
        group_layers: the layers of each recurrence group (the others run once).
        head_shape: ``(n_head, head_dim)``.
        batch_size: rows B.
        capacity: positions S (at most the block size).
        steps: loop steps kept per group (the most any token of that group computes).
        dtype, device: of keys and values (the model's).
    """

    def __init__(self, n_layer: int, group_layers: Sequence[Sequence[int]], head_shape: tuple[int, int],
                 batch_size: int, capacity: int, steps: Sequence[int], dtype: torch.dtype, device: torch.device):
        self.batch_size = batch_size
        self.capacity = capacity
        self.steps = tuple(steps)
        n_head, head_dim = head_shape
        shape = (batch_size, n_head, capacity, head_dim)
        self.group_of: Mapping[int, int] = {layer: group for group, layers in enumerate(group_layers)
                                            for layer in layers}
        self.single: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.looped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(n_layer):
            if layer in self.group_of:
                size = (self.steps[self.group_of[layer]], *shape)
                self.looped[layer] = (torch.zeros(size, dtype=dtype, device=device),
                                      torch.zeros(size, dtype=dtype, device=device))
            else:
                self.single[layer] = (torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device))
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # Positions a read covers (eager decoding: the written prefix, position included); None: all.
        self.limit: int | None = None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # 1-based step numbers of the slots per count kept, shaped to broadcast over [A, K, nh, hs] (write_latest)
        self._slot_numbers = {n: torch.arange(1, n + 1, device=device).view(1, n, 1, 1) for n in set(self.steps)}
        self._rows = torch.arange(batch_size, device=device)

    def row(self, row: int) -> KVCache:
        """Row ``row`` as a cache of one row: its tensors are views of this cache's (what is written through it
        lands here), with a position of its own (the engine's speculation: a batch-1 decoder on one slot)."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.batch_size = 1
        view.single = {layer: tuple(t.narrow(0, row, 1) for t in pair) for layer, pair in self.single.items()}
        view.looped = {layer: tuple(t.narrow(1, row, 1) for t in pair) for layer, pair in self.looped.items()}
        view.position = torch.zeros_like(self.position)
        view.limit, view._views, view._rows = None, {}, self._rows[:1]
        return view

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values ``[B, nh, 1, hs]`` at ``position``; return what layer ``layer``
        at step ``ctx.step`` attends to, ``[B, nh, S, hs]`` each (views, no copy)."""
        cache_k, cache_v = self.read(layer, ctx.step)
        return _write_at(cache_k, cache_v, self.position, keys, values)

    def read(self, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What layer ``layer`` at loop step ``step`` (ignored for a single-pass layer) attends to:
        ``[B, nh, S, hs]`` each (``S``: :attr:`limit` or the capacity), views into the cache."""
        keys, values = self.slots(layer, step)
        if self.limit is not None:  # narrow: a view, without getitem's index parsing (hot path)
            return keys.narrow(2, 0, self.limit), values.narrow(2, 0, self.limit)
        return keys, values

    def slots(self, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[B, nh, capacity, hs]`` key and value tensors of ``layer`` at ``step`` (views made once)."""
        key = (layer, step if layer in self.looped else 0)
        views = self._views.get(key)
        if views is None:
            if layer in self.looped:
                all_keys, all_values = self.looped[layer]
                views = (all_keys[step - 1], all_values[step - 1])
            else:
                views = self.single[layer]
            self._views[key] = views
        return views

    def latest_rows(self, kept: int, rows: np.ndarray, positions: np.ndarray, first: np.ndarray,
                    through: bool = True) -> LatestRows:
        """Where :meth:`write_latest` writes for rows ``rows`` at ``positions`` from steps ``first`` (host arrays
        ``[A]``) in a looped tensor of ``kept`` steps seen as ``[K * B * nh * S, hs]``: slots s_a..K (``through``;
        else s_a alone) of row a, each write's heads in turn; made on the host once per call, for every looped
        layer of it (the eager engine's stores: an ``index_copy_`` instead of a masked write of every slot)."""
        counts = kept - first + 1 if through else np.ones_like(first)
        source = np.repeat(np.arange(first.shape[0]), counts)
        offset = np.arange(source.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
        slot = first[source] + offset  # 1-based, s_a..K
        blocks = (slot - 1) * self.batch_size + rows[source]
        heads, capacity = next(iter(self.looped.values()))[0].shape[2:4]
        index = ((blocks[:, None] * heads + np.arange(heads)) * capacity + positions[source][:, None]).reshape(-1)
        device = self.position.device
        return LatestRows(torch.from_numpy(index).to(device), torch.from_numpy(source).to(device))

    def write_latest(self, tensor: torch.Tensor, new: torch.Tensor, first: int | torch.Tensor | LatestRows,
                     rows: torch.Tensor | None = None, positions: torch.Tensor | slice | int | None = None,
                     at: torch.Tensor | None = None, through: bool = True) -> None:
        """The latest-KV rule, the one place it is written: a row's key (or value) ``new`` of loop step s goes
        into looped ``tensor`` ``[K, B, nh, S, hs]`` (a layer's keys or values) at its position, in the slot of
        step s *and every later step* (``through``; else in its own slot only), so a row that leaves its loop
        after step s leaves its step-s key where later tokens read steps s+1..K; a row still looping overwrites
        them at its next step. Every store calls it, in one of two shapes:

        * ``first`` an int (every row from step ``first``): ``rows`` None (every row), ``positions`` an int or
          a slice, ``new`` broadcast to ``[B, nh, T, hs]``; or ``rows`` ``[A]`` and ``positions`` ``[A]`` (device),
          ``new`` ``[A, nh, hs]``;
        * ``first`` ``[A]`` (each row from its own step; above K: nothing), with ``rows``, ``positions`` ``[A]``
          and ``new`` ``[A, nh, hs]``, the rows ``at`` (``[A]`` bool; None: every row) writing: fixed shapes,
          no host read (the engine's static tick); or ``first`` the same writes prepared on the host
          (:meth:`latest_rows`), ``new`` ``[A, nh, hs]``.
        """
        kept = tensor.shape[0]
        new = new.to(tensor.dtype)
        if isinstance(first, LatestRows):  # one contiguous row of hs per write and head
            tensor.view(-1, tensor.shape[-1]).index_copy_(0, first.index, new.index_select(0, first.source).flatten(0, 1))
            return
        if isinstance(first, int):
            count = (kept - first + 1) if through else min(1, kept - first + 1)
            if count <= 0:
                return
            if rows is None:  # every row: a view of the slots and positions, one broadcast copy
                slots = tensor.narrow(0, first - 1, count)
                if isinstance(positions, slice):
                    slots = slots.narrow(3, positions.start, positions.stop - positions.start)
                else:
                    slots = slots.narrow(3, int(positions), 1)
                slots.copy_(new)
            else:  # [first-1:, rows, :, positions] -> [A, count, nh, hs]
                tensor[first - 1:first - 1 + count, rows, :, positions] = new.unsqueeze(1)
            return
        numbers = self._slot_numbers[kept]
        first = first.view(-1, 1, 1, 1)
        writes = numbers >= first if through else numbers == first  # (A, K, 1, 1)
        if at is not None:
            writes = writes & at.view(-1, 1, 1, 1)
        column = tensor[:, rows, :, positions]  # (A, K, nh, hs)
        tensor[:, rows, :, positions] = torch.where(writes, new.unsqueeze(1), column)

    def settle_all(self, group: int, computed: int, span: slice) -> None:
        """Every row computed ``computed`` loop steps of ``group`` at the positions ``span`` (host
        indices): their slots of the later steps take the key/value of that step (:meth:`write_latest`)."""
        for layer, tensors in self.looped.items():
            if self.group_of[layer] == group:
                for tensor in tensors:
                    latest = tensor[computed - 1].narrow(2, span.start, span.stop - span.start)  # [B, nh, T, hs]
                    self.write_latest(tensor, latest.clone(), computed + 1, positions=span)

    def settle(self, group: int, computed: torch.Tensor) -> None:
        """The current token's loop of ``group`` is over, row b after ``computed[b]`` steps (``[B]``
        long): its slots of the later steps take the key/value of step ``computed[b]``, which is what
        later tokens must read there (the latest rule, :meth:`write_latest`)."""
        rows = self._rows
        positions = self.position.expand(self.batch_size)
        for layer, tensors in self.looped.items():
            if self.group_of[layer] != group:
                continue
            for tensor in tensors:
                column = tensor[:, rows, :, positions]  # (B, K, nh, hs)
                latest = column.gather(1, (computed - 1).view(-1, 1, 1, 1).expand(-1, 1, *column.shape[2:]))
                self.write_latest(tensor, latest.squeeze(1), computed + 1, rows, positions)


class ChunkKV:
    """The store of a lock-step pass over positions ``start .. end - 1``: writes their keys/values and
    reads the cache's first ``end`` positions (the causal mask does the rest)."""

    def __init__(self, cache: KVCache, start: int, end: int):
        self.cache, self.start, self.end = cache, start, end

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` ``[B*T, nh, hs]`` (rows by batch then position) -> ``[B, nh, end, hs]``."""
        cache_k, cache_v = self.cache.slots(layer, ctx.step)
        batch = ctx.n_batch
        span = slice(self.start, self.end)
        cache_k[:, :, span] = keys.view(batch, -1, *keys.shape[1:]).transpose(1, 2)
        cache_v[:, :, span] = values.view(batch, -1, *values.shape[1:]).transpose(1, 2)
        return cache_k[:, :, : self.end], cache_v[:, :, : self.end]


class RowsKV:
    """The store of a teacher-forced pass with exits: packed rows (any rows of any positions, ``[N, nh,
    hs]``) of positions that all run each loop step together. A row still looping at step k writes its
    step-k key; a row that stopped keeps its last, which is what the latest rule asks of step k: one
    slot per looped layer (a cache made with one step per group) is exact, and every step reads it."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.batch_size, self.capacity = cache.batch_size, cache.capacity

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values ``[N, nh, hs]`` (or ``[N, nh, 1, hs]``); return ``[B, nh, S, hs]`` each."""
        if keys.dim() == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        if layer in self.cache.looped:  # its one slot: step 1's, written through to none later
            for tensor, new in zip(self.cache.looped[layer], (keys, values), strict=True):
                self.cache.write_latest(tensor, new, 1, ctx.batch_index, ctx.position)
            return self.cache.slots(layer, 1)
        cache_k, cache_v = self.cache.slots(layer, 1)
        cache_k[ctx.batch_index, :, ctx.position] = keys.to(cache_k.dtype)
        cache_v[ctx.batch_index, :, ctx.position] = values.to(cache_v.dtype)
        return cache_k, cache_v


class ThroughKV:
    """The store of a lock-step pass with exits over new positions (every one before ``end``): packed rows
    (``[N, nh, hs]``, or one per batch row ``[B, nh, 1, hs]``) of the rows still looping at step k. A row
    writes its step-k key/value into the slots of step k *and every later step*, so a row that stops after
    c steps leaves its step-c key in the slots of steps c+1.. -- what :meth:`KVCache.settle` would leave --
    before any later step reads them; a row still looping overwrites them at its next step. Reads are the
    cache's first ``end`` positions (the rows' causal mask does the rest)."""

    def __init__(self, cache: KVCache, end: int):
        self.cache, self.batch_size, self.capacity = cache, cache.batch_size, end

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values at their positions; return ``[B, nh, end, hs]`` each (views)."""
        if keys.dim() == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        rows, positions = ctx.batch_index, ctx.position
        if layer in self.cache.looped:
            for tensor, new in zip(self.cache.looped[layer], (keys, values), strict=True):
                self.cache.write_latest(tensor, new, ctx.step, rows, positions)
        else:
            for tensor, new in zip(self.cache.single[layer], (keys, values), strict=True):
                tensor[rows, :, positions] = new.to(tensor.dtype)
        cache_k, cache_v = self.cache.slots(layer, ctx.step)
        return cache_k.narrow(2, 0, self.capacity), cache_v.narrow(2, 0, self.capacity)


class GivenKV:
    """The keys/values of a few layers handed in as tensors, as the store of a compiled piece: the
    layers see the tensors given for this call (``kv``: K then V, ``[B, nh, S, hs]`` each, per layer of
    ``layers``) and write at ``position``. A loop step's slots are chosen outside the compiled code, so
    that every step of a group runs the same compiled function (the step is no constant inside)."""

    def __init__(self, layers: Sequence[int], kv: Sequence[torch.Tensor], position: torch.Tensor):
        self.tensors = {layer: (kv[2 * index], kv[2 * index + 1]) for index, layer in enumerate(layers)}
        self.position = position

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache_k, cache_v = self.tensors[layer]
        return _write_at(cache_k, cache_v, self.position, keys, values)


def _write_at(cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` ``[B, nh, 1, hs]`` (or ``[B, nh, hs]``) at ``position`` ``[1]`` of ``cache_k``/``cache_v``
    ``[B, nh, S, hs]`` (in place; cast to the cache's dtype under autocast); return the two caches."""
    if keys.dim() == 3:  # [B, nh, hs] from the packing path of attention
        keys, values = keys.unsqueeze(2), values.unsqueeze(2)
    keys, values = keys.to(cache_k.dtype), values.to(cache_v.dtype)  # each on its own: no-ops when they match
    cache_k.index_copy_(2, position, keys)
    cache_v.index_copy_(2, position, values)
    return cache_k, cache_v

"""The engine's key/value cache: one row per batch slot, each row at its own position and loop step.

The storage is the model's :class:`~rdepth.model.kv.KVCache` (one ``[B, nh, S, hs]`` tensor per
single-pass layer, ``[K, B, nh, S, hs]`` per looped layer: slot ``k - 1`` holds what loop step k attends
to). What differs from the lock-step decoder is who reads what: in one batched call, row b writes its
new key at its own position ``p_b`` and, in a loop, into its own step's slot ``k_b``, and attends to the
first ``p_b + 1`` keys of that slot (the mask does the rest). :class:`CallStore` is the store a layer
sees for one such call (``update``, as every store of :mod:`rdepth.model.kv`).

Two layouts (:data:`KV_LAYOUTS`):

* ``exact`` (the default): K slots per looped layer and the latest-KV rule when a token leaves its loop
  early (:meth:`SlotCache.settle`), so every token computes what the batch-1 decoder computes.
* ``shared``: one slot per looped layer, every step overwriting it, so a later token at step k reads an
  earlier token's *final* key instead of its step-k key. The memory per token no longer grows with the
  loop budget (K times less for looped layers); the outputs change (the model was trained on the exact
  rule), which is why it is never the default.
"""

from __future__ import annotations

import torch

from rdepth.model.kv import AttentionContext, KVCache

KV_LAYOUTS = ("exact", "shared")


class SlotCache:
    """Keys/values for ``batch`` slots of ``capacity`` positions (``steps``: slots per group)."""

    def __init__(self, cache: KVCache, layout: str):
        self.cache = cache
        self.layout = layout
        self.batch = cache.batch_size
        self.capacity = cache.capacity
        # (the context's slot_index is unused on the one-query-per-row path: the rows stand in for it)
        self._numbers = {group: torch.arange(1, n + 1, device=cache.position.device).view(1, n, 1, 1)
                         for group, n in enumerate(cache.steps)}

    def bytes_per_token(self) -> int:
        """Bytes of keys and values one position of one slot takes (every layer, every kept step)."""
        total = 0
        for tensors in (*self.cache.single.values(), *self.cache.looped.values()):
            for tensor in tensors:
                total += tensor.element_size() * tensor.numel() // (self.batch * self.capacity)
        return total

    def context(self, rows: torch.Tensor, positions: torch.Tensor, span: int, all_rows: bool,
                steps: torch.Tensor | None = None, same_step: int | None = None,
                same_position: bool = False) -> AttentionContext:
        """The attention context of one batched call over ``rows`` ``[A]`` (slot indices) at
        ``positions`` ``[A]``, reading the first ``span`` positions; in a loop, ``steps`` ``[A]`` (1-based;
        ``same_step`` when every row is at that one). ``all_rows``: ``rows`` is every slot in order (the
        keys are then read as views, without a gather); ``same_position``: besides, every row is at position
        ``span - 1`` (no mask; one write along the positions)."""
        same_position = span if all_rows and same_position else None
        store = CallStore(self, rows, positions, span, all_rows, steps, same_step, same_position)
        if same_position is not None:  # every slot at the last position read: no mask, as the lock-step decoder
            mask = None
        else:
            key_positions = torch.arange(span, device=rows.device)
            mask = (key_positions[None, :] <= positions[:, None]).view(-1, 1, 1, span)  # (A, 1, 1, span)
        return AttentionContext(store, 0, rows, positions, rows, 1, rows.shape[0], mask, one_per_row=True)

    def settle(self, group: int, rows: torch.Tensor, positions: torch.Tensor, computed: torch.Tensor) -> None:
        """Rows ``rows`` ``[E]`` left ``group``'s loop at ``positions`` after ``computed`` ``[E]`` steps: their
        slots of the later steps take the key/value of step ``computed`` (the latest-KV rule; exact layout)."""
        if self.layout != "exact":
            return
        numbers = self._numbers[group]  # (1, K, 1, 1)
        keep = numbers <= computed.view(-1, 1, 1, 1)  # (E, K, 1, 1)
        last = (computed - 1).view(-1, 1, 1, 1)
        for layer, tensors in self.cache.looped.items():
            if self.cache.group_of[layer] != group:
                continue
            for tensor in tensors:  # (K, B, nh, S, hs)
                column = tensor[:, rows, :, positions]  # (E, K, nh, hs): the advanced indices go first
                latest = column.gather(1, last.expand(-1, 1, *column.shape[2:]))  # (E, 1, nh, hs)
                tensor[:, rows, :, positions] = torch.where(keep, column, latest)


class CallStore:
    """The store of one batched call (see :meth:`SlotCache.context`): writes each row's keys/values at its
    position (and step's slot) and returns what each row attends to, ``[A, nh, span, hs]``."""

    def __init__(self, slots: SlotCache, rows, positions, span, all_rows, steps, same_step, same_position=None):
        self.slots, self.rows, self.positions, self.span = slots, rows, positions, span
        self.all_rows, self.same_step = all_rows, same_step
        # every slot writes at one position: one index_copy_ along the positions (the lock-step decoder's write)
        self.position = positions[:1] if same_position is not None else None
        self.flat_index = None
        if steps is not None and slots.layout == "exact" and same_step is None:
            self.flat_index = (steps - 1) * slots.batch + rows  # row of the [K * B, ...] view

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.slots.cache
        keys, values = keys.squeeze(2), values.squeeze(2)  # (A, nh, hs)
        if layer in cache.single:
            tensors = cache.single[layer]
            return tuple(self._write_read(tensor, self.rows, new) for tensor, new in zip(tensors, (keys, values)))
        out = []
        for tensor, new in zip(cache.looped[layer], (keys, values)):  # (K, B, nh, S, hs)
            if self.slots.layout == "shared":
                out.append(self._write_read(tensor[0], self.rows, new))
            elif self.flat_index is None:
                out.append(self._write_read(tensor[self.same_step - 1], self.rows, new))
            else:
                flat = tensor.view(-1, *tensor.shape[2:])  # (K * B, nh, S, hs)
                out.append(self._write_read(flat, self.flat_index, new, gather=True))
        return tuple(out)

    def _write_read(self, tensor: torch.Tensor, index: torch.Tensor, new: torch.Tensor,
                    gather: bool = False) -> torch.Tensor:
        """Write ``new`` ``[A, nh, hs]`` at ``tensor[index[a], :, positions[a]]``; read ``[A, nh, span, hs]``."""
        if self.position is not None and not gather:
            tensor.index_copy_(2, self.position, new.to(tensor.dtype).unsqueeze(2))
            return tensor.narrow(2, 0, self.span)
        tensor[index, :, self.positions] = new.to(tensor.dtype)
        window = tensor.narrow(2, 0, self.span)
        if self.all_rows and not gather:
            return window
        return window.index_select(0, index)

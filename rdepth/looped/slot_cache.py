"""A key/value cache of engine slots for a looped adapter's model: every row at its own position.

``transformers``' caches hold one sequence length for the whole batch, so rows at different positions cannot
share a call over them. :class:`LoopedSlotCache` holds ``batch`` slots of ``capacity`` positions for every cache layer
the model writes (HRM-Text: one per (h, l, layer), its ``cycle_offset`` slots), allocated at the first write.
Before a call, :meth:`LoopedSlotCache.select` names the slots it runs (``rows``) and the position each writes
(``positions``); the model's attention calls :meth:`LoopedSlotCache.update` as it calls a ``transformers`` cache's
(``update(key, value, layer)``): each row's key and value go in at its own position, and the call reads the
selected slots' keys and values up to the furthest position, under :meth:`LoopedSlotCache.attention_mask` (a row
attends to its own positions up to its own, nothing past it).

A slot is zeroed when a new request takes it (:meth:`LoopedSlotCache.clear`): what lies past a row's position is a
former request's, and a non-finite value there would not be masked by a zero weight (0 x inf is NaN).

The latest-KV rule of per-token exits (:mod:`rdepth.looped.exits`) reads and overwrites the entry at each row's
position (:meth:`newest`, :meth:`overwrite_newest`); a ``transformers`` cache's newest entry is its last.
"""

from __future__ import annotations

import torch


class LoopedSlotCache:
    """Keys and values of ``batch`` slots x ``capacity`` positions per cache layer (see the module)."""

    def __init__(self, batch: int, capacity: int) -> None:
        self.batch, self.capacity = batch, capacity
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [batch, heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.rows = torch.zeros(0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        self._reach = 0  # positions a call reads: the furthest selected position + 1
        self._every = False  # the call runs every slot in order (its reads need no gather)

    def select(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """The next call runs slots ``rows`` ``[R]`` (distinct), each writing at ``positions`` ``[R]``."""
        if rows.numel() != positions.numel() or rows.numel() == 0:
            raise ValueError("select: one position per row, and at least one row")
        if int(positions.max()) >= self.capacity or int(positions.min()) < 0:
            raise ValueError(f"select: positions must be in [0, {self.capacity})")
        self.rows, self.positions = rows.long(), positions.long()
        self._reach = int(positions.max()) + 1
        self._every = rows.numel() == self.batch and bool((rows.cpu() == torch.arange(self.batch)).all())

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``[R, 1, 1, reach]``: 0 where a row attends (its positions up to its own), the dtype's lowest
        elsewhere (additive: what eager attention adds and SDPA takes)."""
        keep = torch.arange(self._reach, device=self.positions.device) <= self.positions[:, None]
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        return mask.masked_fill_(~keep, torch.finfo(dtype).min)[:, None, None, :]

    def position_ids(self) -> torch.Tensor:
        """``[R, 1]``: each selected row's position (its rotary angle)."""
        return self.positions[:, None]

    def _layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.batch, like.shape[1], self.capacity, like.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[layer], self.values[layer]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        """Write ``key``/``value`` ``[R, heads, 1, head_dim]`` at each row's position in cache layer ``layer``;
        return the selected slots' keys and values ``[R, heads, reach, head_dim]``."""
        keys, values = self._layer(layer, key)
        keys[self.rows, :, self.positions] = key[:, :, 0]
        values[self.rows, :, self.positions] = value[:, :, 0]
        if self._every:
            return keys[:, :, :self._reach], values[:, :, :self._reach]
        return keys[self.rows, :, :self._reach], values[self.rows, :, :self._reach]

    def newest(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each selected row's entry at its position in ``layer``: keys and values ``[R, heads, head_dim]``."""
        return self.keys[layer][self.rows, :, self.positions], self.values[layer][self.rows, :, self.positions]

    def overwrite_newest(self, layer: int, which: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The entries at the positions of the selected rows ``which`` (bool ``[R]``) become ``keys``/``values``
        ``[R, heads, head_dim]`` (those rows' own)."""
        rows, positions = self.rows[which], self.positions[which]
        self.keys[layer][rows, :, positions] = keys[which]
        self.values[layer][rows, :, positions] = values[which]

    def clear(self, slot: int) -> None:
        """Zero slot ``slot`` in every layer (a new request takes it)."""
        for layer in self.keys:
            self.keys[layer][slot] = 0
            self.values[layer][slot] = 0

    def bytes_per_token(self) -> int:
        """Key/value bytes one position of one slot takes, over every layer written so far."""
        return sum(2 * keys[0, :, 0].numel() * keys.element_size() for keys in self.keys.values())

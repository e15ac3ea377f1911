"""Key/value storage at static shapes for :class:`rdepth.model.decoder.Decoder`.

* :class:`StaticKV` holds, for batch B and ``capacity`` positions, one key/value tensor per
  single-pass layer and one per (looped layer, loop step 1..k) of its group, allocated once. The
  current token's keys are written at a *device* position (``index_copy_``), so nothing on the host
  depends on the data (CUDA graphs). Eager decoding sets :attr:`StaticKV.limit` to the positions
  written so far, and the layers then read only that prefix.
* The latest-KV rule of exits (a later token at step k reads an earlier token's key of step k if
  that token computed step k, else its last computed one) is applied once, when a token's loop
  ends (:meth:`StaticKV.settle` / :meth:`StaticKV.settle_all`: the token's slots of the steps it
  skipped take its last key), so that step k reads its slot as it is, with no scan of the cache.
* :class:`ChunkKV`: the store of a lock-step pass over several new positions (a prompt, a verification).
* :class:`GivenKV`: the slots of a loop step handed to a compiled piece as tensors, so that every
  step of a group runs the same compiled function.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rdepth.model.kv import AttentionContext
from rdepth.model.recurrent import RecurrentLM


class StaticKV:
    """Keys/values of every layer for one new token per row, at fixed shapes.

    Single-pass layer: ``[B, nh, S, hs]`` (K and V). Looped layer of group g: ``[steps_g, B, nh, S,
    hs]``, slot ``k - 1`` holding what step k attends to (the latest-KV rule already applied, see
    :meth:`settle`). ``position`` ``[1]`` (long, on the device) is where the current token writes.
    The :meth:`update` interface is the one the layers call on a :class:`KVStore`.

    Args:
        model: the model (its config and looped layers).
        batch_size: rows B.
        capacity: positions S (at most the block size).
        steps: loop steps kept per group (the most any token of that group computes).
        dtype, device: of keys and values (the model's).
    """

    def __init__(self, model: RecurrentLM, batch_size: int, capacity: int, steps: Sequence[int],
                 dtype: torch.dtype, device: torch.device):
        config = model.config
        self.batch_size = batch_size
        self.capacity = capacity
        self.steps = tuple(steps)
        shape = (batch_size, config.n_head, capacity, config.head_dim)
        self.group_of = {layer: group for group, layers in enumerate(model.group_layers) for layer in layers}
        self.single: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.looped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(config.n_layer):
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
        # 1-based step numbers of the slots, shaped to broadcast over [steps, B, nh, 1, hs]
        self._step_numbers = {group: torch.arange(1, n + 1, device=device).view(n, 1, 1, 1, 1)
                              for group, n in enumerate(self.steps)}

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

    def settle_all(self, group: int, computed: int, span: slice) -> None:
        """Every row computed ``computed`` loop steps of ``group`` at the positions ``span`` (host
        indices): their slots of the later steps take the key/value of that step."""
        start, length = span.start, span.stop - span.start
        for layer, tensors in self.looped.items():
            if self.group_of[layer] == group:
                for tensor in tensors:
                    column = tensor.narrow(3, start, length)  # [K, B, nh, T, hs], a view
                    column.narrow(0, computed, column.shape[0] - computed).copy_(column.narrow(0, computed - 1, 1))

    def settle(self, group: int, computed: torch.Tensor) -> None:
        """The current token's loop of ``group`` is over, row b after ``computed[b]`` steps (``[B]``
        long): its slots of the later steps take the key/value of step ``computed[b]``, which is what
        later tokens must read there (the latest-KV rule of :mod:`rdepth.model.kv`)."""
        numbers = self._step_numbers[group]  # (K, 1, 1, 1, 1)
        last = (computed - 1).view(1, -1, 1, 1, 1)  # (1, B, 1, 1, 1)
        keep = numbers <= computed.view(1, -1, 1, 1, 1)  # (K, B, 1, 1, 1)
        for layer, tensors in self.looped.items():
            if self.group_of[layer] != group:
                continue
            for tensor in tensors:
                column = tensor.index_select(3, self.position)  # (K, B, nh, 1, hs)
                latest = column.gather(0, last.expand(1, *column.shape[1:]))  # (1, B, nh, 1, hs)
                tensor.index_copy_(3, self.position, torch.where(keep, column, latest))


class ChunkKV:
    """The store of a lock-step pass over positions ``start .. end - 1``: writes their keys/values and
    reads the cache's first ``end`` positions (the causal mask does the rest)."""

    def __init__(self, cache: StaticKV, start: int, end: int):
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
    if keys.dtype != cache_k.dtype:
        keys, values = keys.to(cache_k.dtype), values.to(cache_v.dtype)
    cache_k.index_copy_(2, position, keys)
    cache_v.index_copy_(2, position, values)
    return cache_k, cache_v

"""Key/value storage for packed-row attention under recurrence.

In a looped group every layer runs once per loop step, so a token has one
key/value per (layer, step). Two situations need them stored:

* **Cached generation.** A new token at loop step k attends to each earlier
  token's key/value *of step k*, which is what a full uncached forward pass
  computes. The store therefore keeps one tensor per (looped layer, step)
  when ``keep_steps=True``.
* **Early exit.** A token that left the loop after computing c steps has no
  key/value for step k > c. Following Geiping et al. ("latest" lookup), a later
  token then sees that token's *last computed* key/value, step c. The store
  keeps a ``latest`` tensor per layer and the step count per position.

Reading layer l at step k therefore returns, per position j,
``steps[l][k][j]`` if position j computed step k, else ``latest[l][j]``.
Teacher-forced evaluation with exits runs all tokens in lock-step, so there
``latest`` alone is exact and ``keep_steps=False`` saves the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    store: "KVStore"
    step: int
    batch_index: torch.Tensor
    position: torch.Tensor
    slot_index: torch.Tensor
    slots: int
    n_batch: int
    mask: torch.Tensor
    one_per_row: bool = False

    @classmethod
    def build(
        cls, store: "KVStore", step: int, batch_index: torch.Tensor, position: torch.Tensor
    ) -> "AttentionContext":
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


class KVStore:
    """Per-layer key/value tensors ``[B, n_head, capacity, head_dim]``.

    Args:
        batch_size: rows B.
        capacity: positions held (the block size for generation, T otherwise).
        looped_layers: indices of layers inside recurrence groups.
        keep_steps: keep one tensor per (looped layer, loop step); needed when
            tokens are processed at different times (cached generation).
    """

    def __init__(self, batch_size: int, capacity: int, looped_layers: set[int], keep_steps: bool):
        self.batch_size = batch_size
        self.capacity = capacity
        self.looped_layers = set(looped_layers)
        self.keep_steps = keep_steps
        self.length = 0  # positions already filled (advanced by the model after a call)
        self.latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.computed: dict[int, torch.Tensor] = {}  # layer -> [B, capacity] last step written
        # group -> [B, d]: the state each row's last token handed on (warm-started loops start there)
        self.warm: dict[int, torch.Tensor] = {}

    def _zeros(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.batch_size, like.shape[1], self.capacity, like.shape[2])
        return (like.new_zeros(shape), like.new_zeros(shape))

    def update(
        self, layer: int, ctx: AttentionContext, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values ``[N, nh, hs]`` (or ``[N, nh, 1, hs]``, one query per row); return
        what layer ``layer`` at step ``ctx.step`` attends to, ``[B, nh, capacity, hs]`` each."""
        if keys.dim() == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        b, pos = ctx.batch_index, ctx.position
        if layer not in self.latest:
            self.latest[layer] = self._zeros(keys)
        latest_k, latest_v = self.latest[layer]
        latest_k[b, :, pos] = keys
        latest_v[b, :, pos] = values
        if not (self.keep_steps and layer in self.looped_layers):
            return latest_k, latest_v

        step_key = (layer, ctx.step)
        if step_key not in self.steps:
            self.steps[step_key] = self._zeros(keys)
        step_k, step_v = self.steps[step_key]
        step_k[b, :, pos] = keys
        step_v[b, :, pos] = values
        if layer not in self.computed:
            self.computed[layer] = torch.zeros(
                self.batch_size, self.capacity, dtype=torch.long, device=keys.device
            )
        computed = self.computed[layer]
        computed[b, pos] = ctx.step
        has_step = (computed >= ctx.step)[:, None, :, None]  # (B, 1, S, 1)
        return torch.where(has_step, step_k, latest_k), torch.where(has_step, step_v, latest_v)

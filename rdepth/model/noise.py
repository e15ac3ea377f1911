"""Initial loop-state noise keyed by sequence, position and group.

Each recurrence group starts its loop from a random state (Geiping et al.).
:class:`StateNoise` makes that state a function of *which* token it is, not of
how the work was batched: sequence ``s`` (a global id: a held-out window's
index, or a training row's place in the global batch) draws one
``[block_size, d]`` truncated-normal tensor per group from a generator seeded
with ``(seed, s, group)``, and the token at position ``t`` starts from row ``t``
of it. So

- evaluation gives the same numbers whatever the batch size (``rdepth eval``
  and ``rdepth analyze`` agree on the same windows);
- data-parallel ranks draw only their own rows and still reproduce the
  single-process run;
- cached decoding (one position at a time) starts every token from the same
  state as teacher-forced evaluation of the whole sequence.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn


def _mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (well mixed, so neighbouring ids are unrelated)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


class StateNoise:
    """Noise source for :meth:`rdepth.model.RecurrentLM.init_state`.

    ``sequence_ids``: one global id per batch row (``[B]`` ints). Draws are cached
    per (sequence, group), so a decoding loop that asks for one position at a
    time draws each sequence's tensor once.
    """

    def __init__(self, seed: int, sequence_ids: Sequence[int] | torch.Tensor):
        self.seed = int(seed)
        if isinstance(sequence_ids, torch.Tensor):
            sequence_ids = sequence_ids.tolist()
        self.sequence_ids = [int(s) for s in sequence_ids]
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def consecutive(cls, seed: int, first: int, count: int) -> "StateNoise":
        """Rows ``first .. first + count - 1`` (a batch of consecutive windows)."""
        return cls(seed, range(first, first + count))

    def _sequence(self, sequence: int, group: int, length: int, width: int, std: float,
                  device: torch.device) -> torch.Tensor:
        key = (sequence, group)
        cached = self._cache.get(key)
        if cached is None or cached.shape[0] < length or cached.device != device:
            generator = torch.Generator(device=device).manual_seed(_mixed_seed(self.seed, sequence, group))
            cached = torch.empty(length, width, device=device, dtype=torch.float32)
            nn.init.trunc_normal_(cached, 0.0, std, -3 * std, 3 * std, generator=generator)
            self._cache[key] = cached
        return cached

    def draw(self, group: int, batch: int, start: int, length: int, width: int, std: float,
             device: torch.device, block_size: int) -> torch.Tensor:
        """Float32 ``[batch, length, width]``: positions ``start .. start + length - 1``."""
        if batch != len(self.sequence_ids):
            raise ValueError(f"StateNoise holds {len(self.sequence_ids)} sequence ids for a batch of {batch}")
        rows = [self._sequence(s, group, block_size, width, std, device)[start : start + length]
                for s in self.sequence_ids]
        return torch.stack(rows)

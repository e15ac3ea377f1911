"""Batches of token windows: a stateless, resumable random sampler (held-out windows: :mod:`rdepth.run.heldout`).

``BatchSampler.batch(step)`` depends only on (seed, step): the global batch's
window offsets come from ``numpy.random.default_rng([seed, step])``. Resuming
at step N therefore needs no saved loader state (store the seed and step), and
ranks split the same global batch: rank r takes the rows r, r + world_size,
r + 2 * world_size, ... (strided), so the ranks' rows together are exactly the
single-process batch.

Task data adds a problem index (start offsets and difficulties): windows then
start at a problem, and a curriculum (:func:`curriculum_level`) limits the
problems a step may draw to those up to that step's top difficulty; both
depend on the step alone, so resuming needs no more state.
"""

from __future__ import annotations

import numpy as np
import torch

from rdepth.errors import RdepthError


def _check_length(tokens: np.ndarray, block_size: int) -> None:
    if tokens.ndim != 1:
        raise RdepthError(f"token array must be 1-D, got shape {tokens.shape}")
    if len(tokens) < block_size + 1:
        raise RdepthError(f"split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}")


def _windows(
    tokens: np.ndarray, offsets: np.ndarray, block_size: int, mask: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x = tokens[o : o + block_size], y = tokens[o + 1 : o + block_size + 1] per offset; int64
    [len(offsets), block_size]. With a loss ``mask``, targets whose mask is 0 become -1 (ignored)."""
    rows = torch.from_numpy(np.stack([np.asarray(tokens[o:o + block_size + 1], dtype=np.int64) for o in offsets]))
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    if mask is not None:
        keep = np.stack([np.asarray(mask[o + 1:o + block_size + 1], dtype=bool) for o in offsets])
        y[~torch.from_numpy(keep)] = -1
    return x, y


def curriculum_level(step: int, low: int, high: int, steps: int) -> int:
    """The top difficulty allowed at ``step``: ``low + 1`` at step 0 rising linearly to ``high``
    at ``steps`` (``high`` throughout when ``steps`` is 0 or ``low == high``)."""
    if steps <= 0 or high <= low:
        return high
    return min(high, low + 1 + (high - low - 1) * step // steps)


class BatchSampler:
    """Random contiguous windows of a 1-D token array (a ``TokenShards`` split).

    tokens: 1-D integer array (memmap fine), length >= block_size + 1.
    batch_size: rows of the global batch (all ranks together).
    block_size: tokens per row.
    seed: with the step, fixes every batch.
    mask: optional loss mask aligned with ``tokens`` (targets where it is 0 become -1).
    starts, levels: optional problem index (int64 start offsets, ascending, and each
        problem's difficulty): windows start only at these offsets.
    curriculum_steps: with ``levels``, steps over which the top difficulty drawn rises from
        the lowest + 1 to the highest (0: every difficulty from the start).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int,
                 mask: np.ndarray | None = None, starts: np.ndarray | None = None,
                 levels: np.ndarray | None = None, curriculum_steps: int = 0):
        if batch_size < 1:
            raise RdepthError(f"batch_size must be >= 1, got {batch_size}")
        if block_size < 1:
            raise RdepthError(f"block_size must be >= 1, got {block_size}")
        if seed < 0:
            raise RdepthError(f"seed must be >= 0, got {seed}")
        _check_length(tokens, block_size)
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        if mask is not None and len(mask) != len(tokens):
            raise RdepthError(f"loss mask has {len(mask)} entries for {len(tokens)} tokens")
        self.mask = mask
        self.curriculum_steps = curriculum_steps
        self._eligible: dict[int, np.ndarray] = {}
        self.starts = self.levels = None
        if starts is not None:
            starts = np.asarray(starts, dtype=np.int64)
            levels = np.zeros_like(starts) if levels is None else np.asarray(levels, dtype=np.int64)
            if levels.shape != starts.shape:
                raise RdepthError(f"problem index: {len(levels)} difficulties for {len(starts)} starts")
            fits = starts <= len(tokens) - block_size - 1  # a whole window from the start
            if not fits.any():
                raise RdepthError(f"no problem starts a whole window of {block_size + 1} tokens")
            self.starts, self.levels = starts[fits], levels[fits]
            self.low, self.high = int(self.levels.min()), int(self.levels.max())

    def level(self, step: int) -> int | None:
        """The top difficulty drawn at ``step`` (None without a problem index)."""
        if self.levels is None:
            return None
        return curriculum_level(step, self.low, self.high, self.curriculum_steps)

    def _starts_up_to(self, level: int) -> np.ndarray:
        if level not in self._eligible:
            self._eligible[level] = self.starts[self.levels <= level]
        return self._eligible[level]

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch at ``step``: int64 [batch_size], each in [0, len - block_size - 1]."""
        if step < 0:
            raise RdepthError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        if self.starts is not None:
            eligible = self._starts_up_to(self.level(step))
            return eligible[rng.integers(0, len(eligible), size=self.batch_size, dtype=np.int64)]
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size, dtype=np.int64)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for ``rank``'s rows of the global batch at ``step``.

        Both int64 [batch_size // world_size, block_size], y = x shifted by one
        token. Rank r takes global rows r::world_size.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise RdepthError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        if self.batch_size % world_size:
            raise RdepthError(f"batch_size {self.batch_size} is not divisible by world_size {world_size}")
        return _windows(self.tokens, self.offsets(step)[rank::world_size], self.block_size, self.mask)

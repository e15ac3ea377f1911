"""BatchSampler and held-out windows: determinism, resume, rank partition, exact windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdepth.data.loader import BatchSampler
from rdepth.errors import RdepthError

TOKENS = np.arange(1000, dtype=np.uint16)  # token value == its position: windows are checkable


def test_windows_are_shifted_slices_at_the_offsets():
    sampler = BatchSampler(TOKENS, batch_size=8, block_size=16, seed=0)
    x, y = sampler.batch(3)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    offsets = torch.from_numpy(sampler.offsets(3))
    assert torch.equal(x, offsets[:, None] + torch.arange(16))
    assert torch.equal(y, x + 1)
    many = np.concatenate([sampler.offsets(step) for step in range(200)])
    assert many.min() >= 0 and many.max() <= len(TOKENS) - 16 - 1


def test_same_step_same_batch_after_resume():
    straight = BatchSampler(TOKENS, 4, 8, seed=7)
    batches = [straight.batch(step) for step in range(6)]
    resumed = BatchSampler(TOKENS, 4, 8, seed=7)  # a fresh process resuming at step 4
    for step in (4, 5):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch(step), batches[step], strict=False))
    assert not torch.equal(batches[0][0], batches[1][0])
    assert not torch.equal(BatchSampler(TOKENS, 4, 8, seed=8).batch(0)[0], batches[0][0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_partition_the_global_batch(world_size):
    sampler = BatchSampler(TOKENS, batch_size=8, block_size=5, seed=1)
    single_x, single_y = sampler.batch(11)
    parts = [sampler.batch(11, rank=r, world_size=world_size) for r in range(world_size)]
    assert all(px.shape == (8 // world_size, 5) for px, _ in parts)
    for rank, (px, py) in enumerate(parts):  # rank r holds global rows r::world_size
        assert torch.equal(px, single_x[rank::world_size]) and torch.equal(py, single_y[rank::world_size])
    rows = sorted(map(tuple, torch.cat([px for px, _ in parts]).tolist()))
    assert rows == sorted(map(tuple, single_x.tolist()))


def test_sampler_errors():
    with pytest.raises(RdepthError, match="block_size"):
        BatchSampler(np.arange(16), batch_size=2, block_size=16, seed=0)
    BatchSampler(np.arange(17), batch_size=2, block_size=16, seed=0).batch(0)  # exactly enough
    sampler = BatchSampler(TOKENS, batch_size=6, block_size=4, seed=0)
    with pytest.raises(RdepthError, match="divisible"):
        sampler.batch(0, rank=0, world_size=4)
    with pytest.raises(RdepthError, match="rank"):
        sampler.batch(0, rank=2, world_size=2)
    with pytest.raises(RdepthError, match="step"):
        sampler.batch(-1)


def test_held_out_windows_cover_consecutive_windows():
    """The one window maker: window j is tokens[j*T : j*T + T + 1]; a capped count samples them evenly."""
    from rdepth.run.heldout import held_out_windows

    tokens = np.arange(103, dtype=np.uint16)
    windows = held_out_windows(tokens, 10)
    assert tuple(windows.shape) == (10, 11) and windows.dtype == torch.int64
    assert torch.equal(windows[:, :-1].flatten(), torch.arange(100))
    assert torch.equal(windows[:, 1:].flatten(), torch.arange(1, 101))
    # A capped count spreads its windows over the whole split (j = i * 10 // count), in order.
    assert torch.equal(held_out_windows(tokens, 10, max_windows=2), windows[[0, 5]])
    assert torch.equal(held_out_windows(tokens, 10, max_windows=3), windows[[0, 3, 6]])
    assert torch.equal(held_out_windows(tokens, 10, max_windows=10), windows)
    assert torch.equal(held_out_windows(tokens, 10, max_windows=50), windows)  # fewer than asked: all of them
    with pytest.raises(RdepthError):
        held_out_windows(np.arange(10), 10)


def test_loss_mask_turns_unmasked_targets_into_ignored():
    tokens = np.arange(50, dtype=np.uint16)
    mask = (np.arange(50) % 5 == 0).astype(np.uint8)  # every fifth token is a target
    sampler = BatchSampler(tokens, batch_size=3, block_size=8, seed=1, mask=mask)
    x, y = sampler.batch(0)
    plain_x, plain_y = BatchSampler(tokens, batch_size=3, block_size=8, seed=1).batch(0)
    assert torch.equal(x, plain_x)
    kept = y >= 0
    assert torch.equal(y[kept], plain_y[kept]) and bool((y[kept] % 5 == 0).all())
    assert bool((plain_y[~kept] % 5 != 0).all()) and int(kept.sum()) > 0
    with pytest.raises(RdepthError, match="mask"):
        BatchSampler(tokens, batch_size=3, block_size=8, seed=1, mask=mask[:-1])

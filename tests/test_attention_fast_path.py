"""The one-query attention fast path (``AttentionContext.one_per_row``): when a packed-rows call holds
exactly one query per batch row, in batch order, attention views the queries instead of packing them.
SDPA then sees the same values, so everything equals the packing path bit for bit."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from rdepth.model.kv import AttentionContext, KVStore
from rdepth.model.noise import StateNoise
from rdepth.model.static_decode import StaticDecoder

sys.path.insert(0, str(Path(__file__).parent))
from test_static_decode import (  # noqa: E402
    K_MAX, controller_factory, decode_all, tiny_model, tokens, varied_setting)


def packing_always(decoder: StaticDecoder) -> None:
    """Make ``decoder`` take the packing path everywhere (its contexts lose the flag)."""
    for context in decoder._contexts.values():
        context.one_per_row = False
    rows_context = decoder._rows_context
    decoder._rows_context = lambda rows, step: dataclasses.replace(rows_context(rows, step), one_per_row=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", ["sandwich", "gpt2"])
@pytest.mark.parametrize("mode", ["fixed", "exits", "exits_compacted"])
def test_static_decoding_is_bit_identical_with_and_without_the_fast_path(dtype, block, mode):
    """Logits, steps computed, iterates handed on, and every key/value slot of the cache."""
    model = tiny_model(block).to(dtype)
    batch = 3
    idx = tokens(batch)
    noise = StateNoise(2, range(batch))
    options = {"noise": noise}
    if mode == "fixed":
        options["loop_counts"] = (4, 3)
    else:
        setting = varied_setting(model, idx, noise, "acceleration")
        options.update(controller_factory=controller_factory(model, "acceleration", setting), check_every=1,
                       compact=mode == "exits_compacted")
    fast, slow = StaticDecoder(model, batch, K_MAX, **options), StaticDecoder(model, batch, K_MAX, **options)
    assert all(context.one_per_row for context in fast._contexts.values())
    packing_always(slow)
    fast_out, slow_out = decode_all(fast, idx), decode_all(slow, idx)
    for a, b in zip(fast_out, slow_out):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if mode != "fixed":
        assert fast_out[1].min() < fast_out[1].max(), "the exits should vary"
    for layer in fast.cache.looped:
        for a, b in zip(fast.cache.looped[layer], slow.cache.looped[layer]):
            assert torch.equal(a, b)
    for layer in fast.cache.single:
        for a, b in zip(fast.cache.single[layer], slow.cache.single[layer]):
            assert torch.equal(a, b)


def test_build_sets_the_flag_only_for_one_query_per_row_in_order():
    store = KVStore(3, 8, set(), keep_steps=False)
    one_each = AttentionContext.build(store, 1, torch.arange(3), torch.tensor([4, 4, 4]))
    assert one_each.one_per_row
    some_rows = AttentionContext.build(store, 1, torch.tensor([0, 2]), torch.tensor([4, 4]))
    two_each = AttentionContext.build(store, 1, torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([3, 4] * 3))
    assert not some_rows.one_per_row and not two_each.one_per_row


@pytest.mark.parametrize("block", ["sandwich", "gpt2"])
def test_packed_path_layer_call_is_bit_identical_with_the_flag(block):
    """The packed path (generation through a KVStore) sets the flag itself at one token per row: a
    layer's output and the keys it stores equal the packing path's."""
    model = tiny_model(block)
    batch, before = 3, 4
    draw = torch.Generator().manual_seed(0)
    prompt = torch.randn(batch * before, model.config.d_model, dtype=torch.float64, generator=draw)
    x = torch.randn(batch, model.config.d_model, dtype=torch.float64, generator=draw)
    outputs = []
    for flag in (True, False):
        store = KVStore(batch, 8, set(), keep_steps=False)
        earlier = AttentionContext.build(store, 1, torch.arange(batch).repeat_interleave(before),
                                         torch.arange(before).repeat(batch))
        model.layers[0](prompt, earlier)  # positions 0..3 of every row, packed
        context = AttentionContext.build(store, 1, torch.arange(batch), torch.full((batch,), before))
        assert context.one_per_row and not earlier.one_per_row
        outputs.append((model.layers[0](x, dataclasses.replace(context, one_per_row=flag)), store.latest[0]))
    (fast, fast_kv), (slow, slow_kv) = outputs
    assert torch.equal(fast, slow) and all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv))

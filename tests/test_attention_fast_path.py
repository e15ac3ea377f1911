"""The one-query attention fast path (``AttentionContext.one_per_row``): when a packed-rows call holds
exactly one query per batch row, in batch order, attention views the queries instead of packing them.
SDPA then sees the same values, so everything equals the packing path bit for bit. Likewise the static
decoder's additive mask (made once per token) against the boolean mask SDPA converts at every call."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from rdepth.model.decoder import Decoder
from rdepth.model.kv import AttentionContext, RowsKV
from rdepth.model.noise import StateNoise

sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import controller_factory, decode_all, make, tokens, varied_setting  # noqa: E402


def packing_always(decoder: Decoder) -> None:
    """Make ``decoder`` take the packing path everywhere (its contexts lose the flag)."""
    for context in decoder.executor.contexts.values():
        context.one_per_row = False


def boolean_masks(decoder: Decoder) -> None:
    """Make ``decoder`` hand attention a boolean mask (``key <= position``, SDPA converts it at every
    call), refreshed per token beside its own additive one, as the decoder did before."""
    executor = decoder.executor
    boolean = torch.zeros(executor.mask.shape, dtype=torch.bool, device=decoder.device)
    refresh = executor._refresh_mask

    def refresh_both() -> None:
        refresh()
        boolean.copy_(executor.mask == 0)

    executor._refresh_mask = refresh_both
    for context in executor.contexts.values():
        context.mask = boolean


def decode_pair(dtype, block, mode, change):
    """Two equal decoders of 3 rows, ``change`` applied to the second; both decode the same tokens.
    Returns both and their outputs (logits, computed, used)."""
    model = tiny_model(block).to(dtype)
    batch = 3
    idx = tokens(batch)
    noise = StateNoise(2, range(batch))
    options = {"noise": noise, "prefix_reads": False}
    if mode == "fixed":
        options["loop_counts"] = (4, 3)
    else:
        setting = varied_setting(model, idx, noise, "acceleration")
        options.update(controller_factory=controller_factory(model, "acceleration", setting), check_every=1)
    first, second = make(model, batch, **options), make(model, batch, **options)
    change(second)
    return first, second, decode_all(first, idx), decode_all(second, idx)


def assert_bit_identical(first, second, first_out, second_out, mode) -> None:
    """Logits, steps computed, iterates handed on, and every key/value slot of the cache."""
    for a, b in zip(first_out, second_out, strict=False):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if mode != "fixed":
        assert first_out[1].min() < first_out[1].max(), "the exits should vary"
    for layer in first.cache.looped:
        for a, b in zip(first.cache.looped[layer], second.cache.looped[layer], strict=False):
            assert torch.equal(a, b)
    for layer in first.cache.single:
        for a, b in zip(first.cache.single[layer], second.cache.single[layer], strict=False):
            assert torch.equal(a, b)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
BLOCKS = pytest.mark.parametrize("block", ["sandwich", "gpt2"])
MODES = pytest.mark.parametrize("mode", ["fixed", "exits"])


@DTYPES
@BLOCKS
@MODES
def test_static_decoding_is_bit_identical_with_and_without_the_fast_path(dtype, block, mode):
    fast, slow, fast_out, slow_out = decode_pair(dtype, block, mode, packing_always)
    assert all(context.one_per_row for context in fast.executor.contexts.values())
    assert_bit_identical(fast, slow, fast_out, slow_out, mode)


@DTYPES
@BLOCKS
@MODES
def test_static_decoding_is_bit_identical_with_the_additive_and_the_boolean_mask(dtype, block, mode):
    additive, boolean, additive_out, boolean_out = decode_pair(dtype, block, mode, boolean_masks)
    assert additive.executor.mask.dtype == dtype and boolean.executor.contexts[0].mask.dtype == torch.bool
    assert_bit_identical(additive, boolean, additive_out, boolean_out, mode)


def test_the_mask_is_made_once_per_token_and_sdpa_converts_nothing():
    """After a token at position p: 0 at keys 0..p, -inf after, in every row; the token makes the mask
    once (one ``where``), and its attention calls convert nothing (no ``where`` inside SDPA, as there is
    with a boolean mask)."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model()
    batch = 2
    idx = tokens(batch)
    wheres = []
    for change in (None, boolean_masks):
        decoder = make(model, batch, loop_counts=(2, 1), noise=StateNoise(2, range(batch)), prefix_reads=False)
        if change:
            change(decoder)
        decoder.prefill(idx[:, :4])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.step(idx[:, 4:5])
        events = prof.events()
        # single-pass layers 0 and 4; layer 1 at 2 steps; layers 2-3 at 1 step
        assert sum(event.name == "aten::scaled_dot_product_attention" for event in events) == 2 + 2 + 2
        wheres.append((sum(event.name == "aten::where" and inside_attention(event) for event in events),
                       sum(event.name == "aten::where" and not inside_attention(event) for event in events)))
        if change is None:
            expected = torch.full((decoder.capacity,), float("-inf"), dtype=torch.float64)
            expected[:5] = 0
            executor = decoder.executor
            assert executor.mask.dtype == torch.float64
            assert torch.equal(executor.mask, expected.expand(batch, 1, 1, -1))
            assert all(context.mask is executor.mask for context in executor.contexts.values())
    additive, boolean = wheres
    # outside attention: the mask once, and the loop routine's two (hand-off, used index) at each group's
    # last step (a fixed budget: no row stops before it)
    assert additive == (0, 1 + 2 * 2) and boolean[0] >= 6


def inside_attention(event) -> bool:
    """Whether a profiler event ran inside ``scaled_dot_product_attention``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "aten::scaled_dot_product_attention":
            return True
        parent = parent.cpu_parent
    return False


def test_build_sets_the_flag_only_for_one_query_per_row_in_order():
    store = RowsKV(tiny_model("sandwich").new_cache(3, 8))
    one_each = AttentionContext.build(store, 1, torch.arange(3), torch.tensor([4, 4, 4]))
    assert one_each.one_per_row
    some_rows = AttentionContext.build(store, 1, torch.tensor([0, 2]), torch.tensor([4, 4]))
    two_each = AttentionContext.build(store, 1, torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([3, 4] * 3))
    assert not some_rows.one_per_row and not two_each.one_per_row


@pytest.mark.parametrize("block", ["sandwich", "gpt2"])
def test_packed_path_layer_call_is_bit_identical_with_the_flag(block):
    """The packed path (packed rows through the cache) sets the flag itself at one token per row: a
    layer's output and the keys it stores equal the packing path's."""
    model = tiny_model(block)
    batch, before = 3, 4
    draw = torch.Generator().manual_seed(0)
    prompt = torch.randn(batch * before, model.config.d_model, dtype=torch.float64, generator=draw)
    x = torch.randn(batch, model.config.d_model, dtype=torch.float64, generator=draw)
    outputs = []
    for flag in (True, False):
        store = RowsKV(model.new_cache(batch, 8, dtype=torch.float64))
        earlier = AttentionContext.build(store, 1, torch.arange(batch).repeat_interleave(before),
                                         torch.arange(before).repeat(batch))
        model.layers[0](prompt, earlier)  # positions 0..3 of every row, packed
        context = AttentionContext.build(store, 1, torch.arange(batch), torch.full((batch,), before))
        assert context.one_per_row and not earlier.one_per_row
        outputs.append((model.layers[0](x, dataclasses.replace(context, one_per_row=flag)), store.cache.slots(0, 1)))
    (fast, fast_kv), (slow, slow_kv) = outputs
    assert torch.equal(fast, slow) and all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv, strict=False))

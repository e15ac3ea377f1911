"""Inkling-2 (``transformers``' ``Inkling2LoopForCausalLM``, ``model_type: inkling2_loop_text``) as a looped adapter.

Inkling-2 runs its decoder layers ``[loop_layer_index_start, loop_layer_index_end)`` ``loop_num_passes``
times. Besides the hidden state, every layer reads the *block states*: one saved residual per block of
``n_layers_per_attn_res_block`` layers, mixed in by learned attention over blocks (its attention
residuals). A pass's own state is therefore the pair (hidden state at its end, the block states it
appended); every pass restarts from the pre-loop pair, and a pass after the first reads the previous
pass's pair through its message attention and message gates. So one pass *is* a step with its own
state, and the adapter drives it as one:

    enter:  pre-loop layers from the embedding -> (h_pre, blocks_pre)
    pass k: loop layers from (h_pre, blocks_pre), messages from pass k-1's (h, its blocks) when k > 0
            -> (h_k, blocks_pre + pass k's blocks)
    leave:  post-loop layers, the final block attention, the norm;  readout: lm_head + the logit softcap

Leaving after pass k < ``loop_num_passes`` is exactly the model with ``loop_num_passes = k`` (nothing a
pass computes depends on how many passes follow; ``tests/test_looped_inkling2.py`` checks it). The
iterate the geometry reads is the pass's final hidden state ``[B, T, d]`` (step 0: ``h_pre``, where every
pass starts). Each pass writes its own cache layers (the first pass the loop layers' own, pass k > 0
the copies the model appends after its layers) holding keys, values and the short convolutions'
rolling states. Per-token exit of a pass is not offered: a token that left after pass k would need its
later passes' cache copies settled, and those hold the short convolutions' rolling states as well as
keys and values; what the latest-KV rule should mean for a convolution state is not settled here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.looped.protocol import LoopedAdapter, LoopSpec

LOOP = "passes"


@dataclass(frozen=True)
class InklingCarry:
    """A pass's state and the pre-loop state every pass restarts from (``blocks``: ``[B, T, n_blocks, d]``)."""

    hidden: torch.Tensor
    blocks: torch.Tensor
    pre_hidden: torch.Tensor
    pre_blocks: torch.Tensor


@dataclass
class InklingContext:
    embeds: torch.Tensor
    masks: dict[str, Any]
    distances: dict[str, torch.Tensor]
    position_ids: torch.Tensor
    cache: Any


class Inkling2Adapter(LoopedAdapter):
    """``Inkling2LoopForCausalLM`` (text) driven pass by pass: one loop, ``passes``."""

    model_type = "inkling2_loop_text"
    float64_load = {"experts_implementation": "eager"}  # the grouped expert matmul takes no float64 on a CPU

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        config = model.config
        if getattr(config, "model_type", None) != self.model_type:
            raise RdepthError(f"Inkling-2 adapter: model_type {getattr(config, 'model_type', None)!r} is not "
                              f"{self.model_type} (load the text model, Inkling2LoopForCausalLM)")
        self.text = model.model  # Inkling2LoopTextModel
        self.start, self.end = config.loop_layer_index_start, config.loop_layer_index_end
        self.loops = (LoopSpec(LOOP, config.loop_num_passes),)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def embed(self, input_ids: torch.Tensor, cache: Any = None, **extra: Any) -> InklingContext:
        from transformers.masking_utils import (
            create_causal_mask,
            create_recurrent_attention_mask,
            create_sliding_window_causal_mask,
        )
        from transformers.models.inkling2_loop.modeling_inkling2_loop import get_relative_distance

        if extra:
            raise RdepthError(f"Inkling-2 adapter: unknown input(s) {', '.join(sorted(extra))}")
        config = self.model.config
        embeds = self.text.embed_tokens(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + past).unsqueeze(0)
        mask_kwargs = {"config": config, "inputs_embeds": embeds, "attention_mask": None, "cache": cache,
                       "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**mask_kwargs),
                 "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
                 "linear_attention": create_recurrent_attention_mask(**mask_kwargs)}
        distances = {"full_attention": get_relative_distance(embeds, cache, is_sliding=False),
                     "sliding_attention": get_relative_distance(embeds, cache, is_sliding=True)}
        if cache is not None and len(cache.layers) == config.num_hidden_layers:
            # The model's own layout: one copy of the loop layers' cache per pass after the first.
            looped = cache.layers[self.start:self.end]
            cache.layers += [copy.deepcopy(layer) for layer in looped * (config.loop_num_passes - 1)]
        return InklingContext(embeds, masks, distances, position_ids, cache)

    def _layer(self, ctx: InklingContext, layer: Any, hidden: torch.Tensor, blocks: torch.Tensor,
               messages: torch.Tensor | None = None, cache_offset: int | None = None):
        kwargs: dict[str, Any] = {"attention_mask": ctx.masks[layer.attention_type],
                                  "relative_distance": ctx.distances[layer.attention_type],
                                  "conv_mask": ctx.masks["linear_attention"], "cache": ctx.cache,
                                  "position_ids": ctx.position_ids}
        if cache_offset is not None:
            kwargs["cache_offset"] = cache_offset
        updated = layer(hidden, blocks, messages, **kwargs) if messages is not None else layer(hidden, blocks, **kwargs)
        if layer.is_block_boundary:
            blocks = torch.cat([blocks.to(hidden.device), hidden.unsqueeze(-2)], dim=-2)
        return updated, blocks

    def enter(self, ctx: InklingContext, loop: str, carry: Any) -> InklingCarry:
        self.spec(loop)
        hidden = ctx.embeds
        blocks = hidden.new_zeros(*hidden.shape[:-1], 0, hidden.shape[-1])
        for layer in self.text.layers[:self.start]:
            hidden, blocks = self._layer(ctx, layer, hidden, blocks)
        return InklingCarry(hidden, blocks, hidden, blocks)

    def cache_offset(self, index: tuple[int, ...]) -> int:
        """What the model adds to a loop layer's index for pass ``index[-1]`` > 0."""
        config = self.model.config
        return config.num_hidden_layers + (index[-1] - 1) * (self.end - self.start) - self.start

    def kv_slots(self, loop: str, index: tuple[int, ...]) -> tuple[int, ...]:
        self.spec(loop)
        shift = 0 if index[-1] == 0 else self.cache_offset(index)
        return tuple(layer + shift for layer in range(self.start, self.end))

    def step(self, ctx: InklingContext, loop: str, index: tuple[int, ...], carry: InklingCarry) -> InklingCarry:
        self.spec(loop)
        hidden, blocks = carry.pre_hidden, carry.pre_blocks
        layers = self.text.layers[self.start:self.end]
        if index[-1] == 0:
            for layer in layers:
                hidden, blocks = self._layer(ctx, layer, hidden, blocks)
            return InklingCarry(hidden, blocks, carry.pre_hidden, carry.pre_blocks)
        # +1: the block the first loop layer appends is the pre-loop hidden state, not the pass's own.
        previous_blocks = carry.blocks[..., carry.pre_blocks.shape[-2] + 1:, :]
        offset = self.cache_offset(index)
        for position, layer in enumerate(layers):
            messages = self.text.message_input(previous_blocks, carry.hidden, position)
            hidden, blocks = self._layer(ctx, layer, hidden, blocks, messages, offset)
        return InklingCarry(hidden, blocks, carry.pre_hidden, carry.pre_blocks)

    def state(self, loop: str, carry: InklingCarry) -> torch.Tensor:
        return carry.hidden

    def leave(self, ctx: InklingContext, loop: str, carry: InklingCarry) -> torch.Tensor:
        hidden, blocks = carry.hidden, carry.blocks
        for layer in self.text.layers[self.end:]:
            hidden, blocks = self._layer(ctx, layer, hidden, blocks)
        hidden = self.text.final_input(blocks, hidden)[0]
        return self.text.norm(hidden).to(ctx.embeds.dtype)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logit_softcap(self.model.lm_head(hidden).float())

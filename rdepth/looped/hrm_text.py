"""HRM-Text (``transformers``' ``HrmTextForCausalLM``, ``model_type: hrm_text``) as a looped adapter.

Two stacks of the same shape: the fast L stack runs ``L_cycles`` times inside each of ``H_cycles`` slow
H steps. With ``z_H^0`` the scaled token embedding and ``z_L`` starting from the learned ``z_L_init``
(and carried across H steps, never reset):

    L step (h, l):  z_L <- L_module(z_L + z_H)        cache layers (h (L+1) + l) n + j,  j < n
    H step h:       z_H <- H_module(z_H + z_L)        cache layers (h (L+1) + L) n + j
    logits = lm_head(z_H after the last H step)

with n = ``num_layers_per_stack`` (the model's own slot layout, its ``cycle_offset``). Every stack call
is the model's own module; the adapter only orders the calls and keeps the two states. Loops:
``H`` (budget ``H_cycles``) holding ``L`` (budget ``L_cycles``) inside each step. At a smaller budget
the slots of the skipped steps are simply not written (the layout stays the model's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.looped.protocol import LoopedAdapter, LoopSpec
from rdepth.looped.slot_cache import LoopedSlotCache


@dataclass(frozen=True)
class HrmCarry:
    """The two states of HRM's loops, ``[B, T, d]`` each: ``high`` (z_H) and ``low`` (z_L)."""

    high: torch.Tensor
    low: torch.Tensor


@dataclass
class HrmContext:
    """What every stack call of one forward shares."""

    embeds: torch.Tensor  # [B, T, d], already scaled by embedding_scale
    mask: Any
    position_ids: torch.Tensor  # [1, T]
    rotary: tuple[torch.Tensor, torch.Tensor]
    cache: Any


class HrmTextAdapter(LoopedAdapter):
    """``HrmTextForCausalLM`` driven step by step: loops ``H`` (outer) and ``L`` (inside each H step)."""

    model_type = "hrm_text"
    slot_cache = True  # the engine may run its rows at their own positions in one call (rdepth.looped.engine)

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        config = model.config
        if getattr(config, "model_type", None) != self.model_type:
            raise RdepthError(f"HRM-Text adapter: model_type {getattr(config, 'model_type', None)!r} is not hrm_text")
        self.inner = model.model  # HrmTextModel
        self.layers_per_stack = config.num_layers_per_stack
        self.loops = (LoopSpec("H", config.H_cycles, inner="L"), LoopSpec("L", config.L_cycles))

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def embed(self, input_ids: torch.Tensor, cache: Any = None, token_type_ids: torch.Tensor | None = None,
              **extra: Any) -> HrmContext:
        from transformers.masking_utils import create_causal_mask

        if extra:
            raise RdepthError(f"HRM-Text adapter: unknown input(s) {', '.join(sorted(extra))}")
        inner, config = self.inner, self.model.config
        embeds = inner.embed_tokens(input_ids) * inner.embedding_scale
        if isinstance(cache, LoopedSlotCache):  # the engine's slots: each row one token at its own position
            if input_ids.shape[1] != 1 or token_type_ids is not None:
                raise RdepthError("HRM-Text adapter: a slot cache takes one token per row and no token types")
            position_ids = cache.position_ids()
            return HrmContext(embeds, cache.attention_mask(embeds.dtype), position_ids,
                              inner.rotary_emb(embeds, position_ids), cache)
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + past).unsqueeze(0)
        mask_kwargs = {"config": config, "inputs_embeds": embeds, "attention_mask": None, "cache": cache,
                       "position_ids": position_ids}
        # The prefix-LM overlay (bidirectional instruction tokens) applies to the first call only, as in the model.
        if token_type_ids is not None and config.prefix_lm and (cache is None or not cache.is_initialized):
            mask_kwargs["block_sequence_ids"] = torch.where(token_type_ids == 1, 0, -1)
        mask = create_causal_mask(**mask_kwargs)
        rotary = inner.rotary_emb(embeds, position_ids)
        return HrmContext(embeds, mask, position_ids, rotary, cache)

    def enter(self, ctx: HrmContext, loop: str, carry: HrmCarry | None) -> HrmCarry:
        if loop == "H":
            high = ctx.embeds
            low = self.inner.z_L_init.to(dtype=high.dtype, device=high.device).expand_as(high).contiguous()
            return HrmCarry(high, low)
        self.spec(loop)
        return carry  # the L loop starts from the z_L the previous H step left

    def slot_offset(self, loop: str, index: tuple[int, ...]) -> int:
        """The model's ``cycle_offset`` of a step: its first cache layer."""
        cycles = self.model.config.L_cycles
        if loop == "L":
            high, low = index
            return (high * (cycles + 1) + low) * self.layers_per_stack
        self.spec(loop)
        return (index[0] * (cycles + 1) + cycles) * self.layers_per_stack

    def kv_slots(self, loop: str, index: tuple[int, ...]) -> tuple[int, ...]:
        first = self.slot_offset(loop, index)
        return tuple(range(first, first + self.layers_per_stack))

    def step(self, ctx: HrmContext, loop: str, index: tuple[int, ...], carry: HrmCarry) -> HrmCarry:
        # The model's own order of the sums: L reads z_L + z_H, H reads z_H + z_L.
        if loop == "L":
            stack, total = self.inner.L_module, carry.low + carry.high
        else:
            stack, total = self.inner.H_module, carry.high + carry.low
        updated = stack(total, attention_mask=ctx.mask, cache=ctx.cache,
                        position_embeddings=ctx.rotary, position_ids=ctx.position_ids,
                        cycle_offset=self.slot_offset(loop, index))
        return replace(carry, low=updated) if loop == "L" else replace(carry, high=updated)

    def state(self, loop: str, carry: HrmCarry) -> torch.Tensor:
        return carry.low if loop == "L" else carry.high

    def leave(self, ctx: HrmContext, loop: str, carry: HrmCarry) -> Any:
        return carry.high if loop == "H" else carry

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

"""Eager decoder pieces reading the whole cache, or a fixed span of it, under an additive mask.

Compiled pieces and captured graphs need fixed shapes: attention reads the cache's first ``span``
positions (None: all of them) whatever is written, and a mask ``[B, 1, 1, S]`` (0: written, -inf: not
yet), refilled in place at every token, keeps out what is not written. One set of attention contexts
per span, made when first read.
"""

from __future__ import annotations

import torch

from rdepth.errors import RdepthError
from rdepth.model.executors.eager import Executor
from rdepth.model.kv import AttentionContext


class Masked(Executor):
    """The decoder's pieces eagerly, attention under the additive mask (see the module); one per decoder."""

    def __init__(self, check_every: int | None = 1):
        super().__init__(check_every)
        self.decoder = None

    def attach(self, decoder) -> None:
        """The mask and the whole cache's contexts of ``decoder`` (once: attached again, nothing changes)."""
        if self.decoder is decoder:
            return
        if self.decoder is not None:
            raise RdepthError(f"decoder: a {type(self).__name__} executor serves one decoder")
        self.decoder = decoder
        batch, capacity, dtype, device = decoder.batch_size, decoder.capacity, decoder.dtype, decoder.device
        self.mask = torch.zeros(batch, 1, 1, capacity, dtype=dtype, device=device)
        self._key_positions = torch.arange(capacity, device=device)
        self._open = torch.zeros((), dtype=dtype, device=device)
        self._shut = torch.full((), float("-inf"), dtype=dtype, device=device)
        self._span_contexts: dict[int | None, dict[int, AttentionContext]] = {}
        self.span: int | None = -1  # positions the attention reads now (None: the whole cache; -1: none yet)
        self.read_span(None)

    def read_span(self, span: int | None) -> None:
        """Attention reads the cache's first ``span`` positions (None: all) under the mask's same span."""
        if span == self.span:
            return
        self.span = span
        self.decoder.cache.limit = span
        if span not in self._span_contexts:
            self._span_contexts[span] = self.decoder.attention_contexts(
                self.mask if span is None else self.mask.narrow(3, 0, span))
        self.contexts = self._span_contexts[span]

    def begin_token(self, decoder) -> None:
        self._refresh_mask()

    def _refresh_mask(self) -> None:
        """``mask`` for the current position, in place: 0 at the keys written so far and this token's,
        -inf after (what SDPA would make of the boolean mask ``key <= position``, at every call)."""
        readable = (self._key_positions <= self.decoder.cache.position).view(1, 1, 1, -1)  # (1, 1, 1, S)
        torch.where(readable.expand(self.mask.shape), self._open, self._shut, out=self.mask)

    def run_layers(self, decoder, layers: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        return decoder.model.run_layers(layers, x, self.contexts[0])

    def loop_step(self, decoder, group: int, state: torch.Tensor, step: int) -> torch.Tensor:
        return decoder.model.loop_step(group, state, decoder.inputs, self.contexts[step])

    def run_token(self, decoder, plan) -> None:
        decoder.cache.limit = self.span  # the span read (eager pieces elsewhere set it per token)
        decoder.run_pieces(plan)

"""The decoder's executor: eager pieces over the written prefix of the cache, and the interface every
executor keeps."""

from __future__ import annotations

import torch

from rdepth.errors import RdepthError
from rdepth.model.loop import LoopRows


class Executor:
    """Runs a decoder's pieces eagerly (see :mod:`rdepth.model.executors`): attention reads the written
    prefix of the cache (the decoder's ``contexts``, no mask).

    Args:
        check_every: loop steps of an exit loop between two host checks whether a row still loops (the
            remaining chunks of a group are skipped when none does); None: never checked, every step
            predicated (no host read at all).
    """

    def __init__(self, check_every: int | None = 1):
        if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                        or check_every < 1):
            raise RdepthError(f"decoder: check_every must be >= 1 or None, got {check_every!r}")
        self.check_every = check_every

    def attach(self, decoder) -> None:
        """Called by :meth:`Decoder.use` once the decoder runs through this executor."""

    def begin_token(self, decoder) -> None:
        """Called inside a token's first piece, after the embedding (an executor's per-token set-up)."""

    def run_layers(self, decoder, layers: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        """A run of single-pass ``layers`` on ``x`` ``[B, d]`` at the current position."""
        return decoder.model.run_layers(layers, x, decoder.contexts[0])

    def loop_step(self, decoder, group: int, state: torch.Tensor, step: int) -> torch.Tensor:
        """Loop step ``step`` of ``group`` for every row: ``[B, d]`` -> ``[B, d]`` (input half: ``decoder.inputs``)."""
        return decoder.model.loop_step(group, state, decoder.inputs, decoder.contexts[step])

    def exit_step(self, decoder, loop: LoopRows, step: int, state: torch.Tensor) -> torch.Tensor:
        """One predicated loop step with the loop routine's bookkeeping; returns the new iterate."""
        new = self.loop_step(decoder, loop.group, state, step)
        loop.step_all(step, state, new)
        return new

    def run_token(self, decoder, plan) -> None:
        """One token's pieces, attention reading the positions written so far and this token's."""
        decoder.cache.limit = decoder.length + 1
        decoder.run_pieces(plan)

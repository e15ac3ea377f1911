"""Calls of the one decoder: text generation with a key/value cache that is exact under recurrence, and
the teacher-forced pass every evaluation scores with (warm start runs through the decoder)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rdepth.errors import RdepthError
from rdepth.model.control import LoopController
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import ModelOutput, RecurrentLM, lm_loss


@torch.no_grad()
def generate(
    model: RecurrentLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    loop_counts: Sequence[int] | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    noise: StateNoise | None = None,
    rng: torch.Generator | None = None,
    warm_start: bool = False,
) -> torch.Tensor:
    """Extend ``idx`` ``[B, T0]`` by up to ``max_new_tokens`` tokens through :class:`Decoder`.

    The prompt runs once, then one token per step, each reading the cached keys/values of every
    earlier position at the same loop step (or its last computed step when it exited early).
    ``temperature=0`` (the default, as :meth:`Decoder.generate`'s) is greedy; sampling draws from ``rng`` on the device.
    Generation stops at the model's block size. ``noise``: the initial loop states (a
    :class:`StateNoise`, one id per row; default ids ``0..B-1`` with seed 0). ``warm_start``: each
    group's loop starts from the state it handed on at the previous token.
    ``controller_factory``: per-token exits (``loop_counts`` is then unused).
    """
    if noise is not None and not isinstance(noise, StateNoise):
        raise RdepthError("generate: the initial loop states come from a StateNoise (one sequence id per row)")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise RdepthError(f"generate: temperature must be >= 0 and top_k >= 1, got {temperature}, {top_k}")
    if idx.shape[1] > model.config.block_size:
        raise RdepthError(f"generate: a prompt of {idx.shape[1]} tokens exceeds the model's block size "
                          f"{model.config.block_size}")
    decoder = Decoder(model, idx.shape[0], loop_counts=None if controller_factory is not None else loop_counts,
                      controller_factory=controller_factory, noise=noise, warm_start=warm_start,
                      capacity=min(model.config.block_size, idx.shape[1] + max(max_new_tokens, 1)))
    return decoder.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, rng=rng)


def teacher_forced(
    model: RecurrentLM,
    idx: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    loop_counts: Sequence[int] | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    noise: StateNoise | None = None,
    warm_start: bool = False,
) -> ModelOutput:
    """The model's output on ``idx`` ``[B, T]`` (with ``targets``, the mean cross-entropy), at the fixed
    ``loop_counts`` or under a fresh controller from ``controller_factory`` (per-token exits).

    Without ``warm_start`` every position runs at once (the model's forward: dense, or packed rows in
    lock-step under the controller). With it each group's loop starts from the state it handed on at the
    previous position, so positions run one at a time through :class:`Decoder`: the same computation as
    cached decoding (``noise``: a :class:`StateNoise`; default ids ``0..B-1`` with seed 0)."""
    if loop_counts is not None and controller_factory is not None:
        raise RdepthError("teacher_forced: give loop_counts or controller_factory, not both")
    if not warm_start:
        if controller_factory is not None:
            return model(idx, targets, controller=controller_factory(), noise=noise)
        return model(idx, targets, loop_counts, noise=noise)
    if noise is not None and not isinstance(noise, StateNoise):
        raise RdepthError("teacher_forced: warm start draws its initial loop states from a StateNoise")
    counts = None if controller_factory is not None else model.resolve_loop_counts(loop_counts)
    decoder = Decoder(model, idx.shape[0], loop_counts=counts, controller_factory=controller_factory, noise=noise,
                      capacity=idx.shape[1], warm_start=True)
    logits = decoder.prefill(idx)
    computed, used = list(decoder.prompt_computed.unbind(0)), list(decoder.prompt_used.unbind(0))
    loss = lm_loss(logits, targets.to(logits.device)) if targets is not None else None
    return ModelOutput(logits, loss, counts, computed, used)

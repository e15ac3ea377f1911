"""Text generation with a key/value cache that is exact under recurrence."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from rdepth.model.control import LoopController
from rdepth.model.recurrent import Noise, RecurrentLM


@torch.no_grad()
def generate(
    model: RecurrentLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    loop_counts: Sequence[int] | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    generator: Noise = None,
    sample_generator: torch.Generator | None = None,
    warm_start: bool = False,
) -> torch.Tensor:
    """Extend ``idx`` ``[B, T0]`` by up to ``max_new_tokens`` tokens.

    The prompt is processed once, then one token per forward, each reading the
    cached keys/values of every earlier position at the same loop step (or its
    last computed step when it exited early). ``temperature=0`` is greedy.
    Generation stops at the model's block size. ``warm_start``: each group's loop
    starts from the state it handed on at the previous token (see
    :meth:`RecurrentLM.forward`); the prompt then runs token by token.
    """
    model.eval()
    cache = model.new_cache(idx.shape[0])
    tokens = idx
    step_input = idx
    for _ in range(max_new_tokens):
        if cache.length + step_input.shape[1] > model.config.block_size:
            break
        controller = controller_factory() if controller_factory is not None else None
        out = model(step_input, loop_counts=loop_counts, generator=generator, controller=controller, cache=cache,
                    warm_start=warm_start)
        logits = out.logits[:, -1, :].float()
        if temperature <= 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, 1, generator=sample_generator)
        tokens = torch.cat([tokens, next_token], dim=1)
        step_input = next_token
    return tokens

"""The next token from logits, on the device: greedy, temperature, top-k."""

from __future__ import annotations

import torch


def choose_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token per row, ``[B, 1]`` long, on the logits' device: the argmax when ``temperature``
    <= 0, else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)

"""The next token from logits, on the device: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import torch


def token_probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                        top_p: float = 1.0) -> torch.Tensor:
    """The distribution :func:`choose_tokens` draws from at ``temperature`` > 0, ``[B, V]`` float32 (float64
    logits too): ``softmax(logits / temperature)`` restricted to the ``top_k`` largest and then to the
    smallest set of the largest whose probability reaches ``top_p`` (nucleus; 1: all)."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(dim=-1) - torch.softmax(ordered, dim=-1)
        drop = before >= top_p  # the mass before a token already reaches top_p: outside the nucleus
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def choose_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """The next token per row, ``[B, 1]`` long, on the logits' device: the argmax when ``temperature``
    <= 0, else a draw from :func:`token_probabilities`."""
    if temperature <= 0:
        return logits.float().argmax(dim=-1, keepdim=True)
    return torch.multinomial(token_probabilities(logits, temperature, top_k, top_p), 1, generator=generator)

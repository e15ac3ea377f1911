"""Validation: cross-entropy and perplexity at fixed loop counts per group."""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from rdepth.data.loader import eval_batches
from rdepth.model import ModelOutput, RecurrentLM


def eval_outputs(
    model: RecurrentLM,
    tokens: np.ndarray,
    forward: Callable[[torch.Tensor, torch.Tensor], ModelOutput],
    *,
    batch_size: int,
    block_size: int | None = None,
    max_batches: int | None = None,
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Iterator[tuple[ModelOutput, int]]:
    """The held-out loop every evaluation shares: ``forward(x, y)`` on consecutive windows.

    The model is in eval mode while the loop runs (train mode is restored after) and
    ``forward`` runs under autocast when ``autocast_dtype`` is given. Yields each output and
    its number of target tokens. Call it under ``torch.no_grad()``.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    batches = eval_batches(tokens, batch_size, block_size or model.config.block_size, max_batches)
    if progress:
        batches = tqdm(batches, desc="eval", leave=False)
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                output = forward(x, y)
            yield output, y.numel()
    finally:
        if was_training:
            model.train()


@torch.no_grad()
def evaluate(
    model: RecurrentLM,
    tokens: np.ndarray,
    *,
    loop_counts: Sequence[int] | None = None,
    batch_size: int = 16,
    max_batches: int | None = None,
    block_size: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """Mean next-token cross-entropy (nats) and perplexity over consecutive windows.

    ``loop_counts`` per group (default: the model's eval counts, also in train mode). The
    random initial states come from a generator seeded with ``seed``, so a call is
    reproducible.
    """
    counts = model.config.default_eval_loops if loop_counts is None else model.resolve_loop_counts(loop_counts)
    generator = torch.Generator(device=device).manual_seed(seed)
    total_loss, total_tokens = 0.0, 0
    for out, n_tokens in eval_outputs(
        model, tokens, lambda x, y: model(x, y, counts, generator=generator), batch_size=batch_size,
        block_size=block_size, max_batches=max_batches, device=device, autocast_dtype=autocast_dtype,
    ):
        total_loss += out.loss.item() * n_tokens
        total_tokens += n_tokens
    ce = total_loss / max(total_tokens, 1)
    return {"loop_counts": list(counts), "ce": ce, "ppl": math.exp(ce), "tokens": total_tokens}

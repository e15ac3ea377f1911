"""Validation: cross-entropy and perplexity at fixed loop counts per group."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from rdepth.data.loader import eval_batches
from rdepth.model import RecurrentLM


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

    ``loop_counts`` per group (default: the model's eval counts). The random
    initial states come from a generator seeded with ``seed``, so a call is
    reproducible.
    """
    was_training = model.training
    model.eval()
    block_size = block_size or model.config.block_size
    counts = model.resolve_loop_counts(loop_counts)
    generator = torch.Generator(device=device).manual_seed(seed)
    total_loss = 0.0
    total_tokens = 0
    for x, y in eval_batches(tokens, batch_size, block_size, max_batches):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            out = model(x, y, counts, generator=generator)
        total_loss += out.loss.item() * y.numel()
        total_tokens += y.numel()
    if was_training:
        model.train()
    ce = total_loss / max(total_tokens, 1)
    return {"loop_counts": list(counts), "ce": ce, "ppl": math.exp(ce), "tokens": total_tokens}

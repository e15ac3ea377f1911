"""The one held-out evaluation loop, and cross-entropy at fixed loop counts.

``rdepth eval``, the trainer's validation, ``rdepth analyze``, ``rdepth sweep``
and the demo all run held-out windows through :func:`eval_outputs`, with the
same initial-state noise: window i (its index in the held-out windows) starts
every group's loop from ``StateNoise`` row i of ``seed``. The numbers therefore
do not depend on the batch size or on which command computed them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from tqdm import tqdm

from rdepth.model import ModelOutput, RecurrentLM
from rdepth.model.generation import teacher_forced
from rdepth.model.noise import StateNoise

# forward(x [B, T], y [B, T], noise) -> ModelOutput
Forward = Callable[[torch.Tensor, torch.Tensor, StateNoise], ModelOutput]


def eval_outputs(
    model: RecurrentLM,
    windows: torch.Tensor,
    forward: Forward,
    *,
    batch_size: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
    desc: str = "eval",
    masks: torch.Tensor | None = None,
) -> Iterator[tuple[ModelOutput, int]]:
    """Run ``forward`` over ``windows`` (int64 ``[S, T + 1]``) in batches of ``batch_size``.

    ``masks`` (bool ``[S, T + 1]``, aligned with ``windows``): score only the targets
    where it is True (the others become -1, ignored by the loss), e.g. a task's answers.
    The model is in eval mode while the loop runs (train mode is restored after);
    ``forward`` runs under autocast when ``autocast_dtype`` is given. Yields each
    output and its number of scored target tokens. Call it under ``torch.no_grad()``.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    starts = range(0, windows.shape[0], batch_size)
    try:
        for first in tqdm(starts, desc=desc, leave=False, disable=not progress or len(starts) < 2):
            batch = windows[first : first + batch_size].to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            if masks is not None:
                y = y.masked_fill(~masks[first : first + batch_size, 1:].to(device), -1)
            noise = StateNoise.consecutive(seed, first, batch.shape[0])
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                output = forward(x, y, noise)
            yield output, int((y >= 0).sum()) if masks is not None else y.numel()
    finally:
        if was_training:
            model.train()


@torch.no_grad()
def evaluate(
    model: RecurrentLM,
    windows: torch.Tensor,
    *,
    loop_counts: Sequence[int] | int | None = None,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
    masks: torch.Tensor | None = None,
    warm_start: bool = False,
) -> dict:
    """Mean next-token cross-entropy (nats) and perplexity over ``windows`` ``[S, T + 1]``.

    ``loop_counts`` per group (default: the model's eval counts, also in train mode);
    ``warm_start``: loops start from the previous position's state (token by token).
    """
    counts = model.config.default_eval_loops if loop_counts is None else model.resolve_loop_counts(loop_counts)
    total_loss, total_tokens = 0.0, 0
    for out, n_tokens in eval_outputs(
        model, windows,
        lambda x, y, noise: teacher_forced(model, x, y, loop_counts=counts, noise=noise, warm_start=warm_start),
        batch_size=batch_size,
        device=device, seed=seed, autocast_dtype=autocast_dtype, progress=progress, masks=masks,
    ):
        total_loss += out.loss.item() * n_tokens
        total_tokens += n_tokens
    ce = total_loss / max(total_tokens, 1)
    return {"loop_counts": list(counts), "ce": ce, "ppl": perplexity(ce), "tokens": total_tokens}


def perplexity(ce: float) -> float:
    """exp(ce), infinite (not an overflow) for a diverged model."""
    return math.exp(ce) if ce < 700 else math.inf


def unigram_baseline(windows: torch.Tensor, log_probs, masks: torch.Tensor | None = None) -> dict:
    """Cross-entropy (nats) and perplexity of the train-split unigram model on exactly the targets
    :func:`evaluate` scores (``windows[:, 1:]``, restricted to ``masks`` when given)."""
    targets = windows[:, 1:]
    if masks is not None:
        targets = targets[masks[:, 1:]]
    table = torch.as_tensor(log_probs, dtype=torch.float64)
    if int(targets.max()) >= table.numel():
        raise ValueError("held-out token ids exceed the unigram table")
    ce = float(-table[targets.reshape(-1)].mean())
    return {"ce": ce, "ppl": perplexity(ce), "tokens": int(targets.numel()), "estimated_on": "train split, add-one"}

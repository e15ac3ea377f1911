"""Wall-clock latency of a forward pass with exits: warm, synchronised, median of repeats."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.control import LoopController


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that a timer reads finished work only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_calls(call: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """``warmup`` untimed calls, then ``repeats`` synchronised wall-clock timings in milliseconds."""
    for _ in range(warmup):
        call()
    times_ms = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    return times_ms


@torch.no_grad()
def time_forward(
    model: RecurrentLM,
    idx: torch.Tensor,
    *,
    controller_factory: Callable[[], LoopController] | None = None,
    loop_counts: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """Milliseconds per token of ``model(idx)`` (teacher-forced, all positions at once).

    ``idx`` ``[B, T]`` on the model's device. Either ``controller_factory``
    (a fresh controller per call: per-token exits) or ``loop_counts`` (the
    dense fixed-budget path). ``warmup`` untimed calls, then ``repeats`` timed
    ones, each between device synchronisations, with the same initial states
    (generator reseeded). Returns ``ms_per_token`` (median call time /
    ``B*T``), ``median_ms``, ``all_ms`` and the shape.
    """
    if (controller_factory is None) == (loop_counts is None):
        raise RdepthError("time_forward: give exactly one of controller_factory or loop_counts")
    if warmup < 0 or repeats < 1:
        raise RdepthError(f"time_forward: need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    device = idx.device
    generator = torch.Generator(device=device)

    def call() -> None:
        generator.manual_seed(seed)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            if loop_counts is not None:
                model(idx, loop_counts=loop_counts, generator=generator)
            else:
                model(idx, controller=controller_factory(), generator=generator)

    model.eval()
    times_ms = _timed_calls(call, device, warmup, repeats)
    median = statistics.median(times_ms)
    return {
        "ms_per_token": median / idx.numel(),
        "median_ms": median,
        "all_ms": times_ms,
        "batch_size": int(idx.shape[0]),
        "seq_len": int(idx.shape[1]),
    }


@torch.no_grad()
def time_generate(
    model: RecurrentLM,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    controller_factory: Callable[[], LoopController] | None = None,
    loop_counts: Sequence[int] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
) -> dict:
    """Milliseconds per generated token of greedy cached generation after ``prompt`` ``[B, P]``.

    Each call generates ``new_tokens`` tokens (the prompt's own forward is
    timed too, and amortised over them). Returns ``ms_per_token`` (median /
    ``B * new_tokens``), ``median_ms`` and ``all_ms``.
    """
    from rdepth.model.generation import generate

    if (controller_factory is None) == (loop_counts is None):
        raise RdepthError("time_generate: give exactly one of controller_factory or loop_counts")
    if new_tokens < 1 or prompt.shape[1] + new_tokens > model.config.block_size:
        raise RdepthError(
            f"time_generate: need 1 <= new_tokens and prompt + new tokens <= block size {model.config.block_size}"
        )
    device = prompt.device
    generator = torch.Generator(device=device)

    def call() -> None:
        generator.manual_seed(seed)
        generate(model, prompt, new_tokens, temperature=0.0, loop_counts=loop_counts,
                 controller_factory=controller_factory, generator=generator)

    times_ms = _timed_calls(call, device, warmup, repeats)
    median = statistics.median(times_ms)
    return {"ms_per_token": median / (prompt.shape[0] * new_tokens), "median_ms": median, "all_ms": times_ms}

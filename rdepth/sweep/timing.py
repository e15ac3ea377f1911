"""Wall-clock latency: warm, synchronised, interleaved repeats, median and interquartile range.

Two kinds of call are timed, both under the sweep's autocast:

* :func:`forward_call`: a **teacher-forced** forward of ``idx`` ``[B, T]``,
  all T positions at once; its wall time / ``B*T`` is "teacher-forced
  ms/token", *not* decode latency. Two paths: ``loop_counts`` is the dense
  fixed-budget path; ``controller_factory`` is the packed path (active rows
  gathered, per-token keys/values) that every exit policy takes, and that a
  fixed budget takes with :class:`rdepth.model.control.FixedController`.
* :func:`generate_call`: greedy cached generation of ``new_tokens`` tokens
  after a prompt through the one decoder (:class:`rdepth.model.decoder.Decoder`,
  what ``rdepth generate`` runs): its wall time / ``B*new_tokens`` is the decode
  latency (prompt pass amortised).

:func:`time_interleaved` times several calls against each other: each is warmed
up, then every round calls each once in a shuffled order, so the reference and
every candidate alternate for the whole measurement and a burst of load lands
on rounds rather than on one setting. Statistics and the noise rule are in
:mod:`rdepth.sweep.stats`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.control import LoopController

Call = Callable[[], None]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that a timer reads finished work only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _one_mode(name: str, controller_factory, loop_counts) -> None:
    if (controller_factory is None) == (loop_counts is None):
        raise RdepthError(f"{name}: give exactly one of controller_factory or loop_counts")


def forward_call(
    model: RecurrentLM,
    idx: torch.Tensor,
    *,
    controller_factory: Callable[[], LoopController] | None = None,
    loop_counts: Sequence[int] | None = None,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> Call:
    """A zero-argument call running ``model(idx)`` teacher-forced (``idx`` ``[B, T]`` on the model's device).

    Either ``controller_factory`` (a fresh controller per call: the packed path)
    or ``loop_counts`` (the dense path). Every call starts from the same initial
    states (its generator reseeded to ``seed``).
    """
    _one_mode("forward_call", controller_factory, loop_counts)
    device = idx.device
    generator = torch.Generator(device=device)

    @torch.no_grad()
    def call() -> None:
        generator.manual_seed(seed)
        with _autocast(device, autocast_dtype):
            if loop_counts is not None:
                model(idx, loop_counts=loop_counts, noise=generator)
            else:
                model(idx, controller=controller_factory(), noise=generator)

    return call


def generate_call(
    model: RecurrentLM,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    controller_factory: Callable[[], LoopController] | None = None,
    loop_counts: Sequence[int] | None = None,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> Call:
    """A zero-argument call generating ``new_tokens`` greedy tokens after ``prompt`` ``[B, P]`` with the
    key/value cache (the prompt's forward included), under ``autocast_dtype``."""
    from rdepth.model.generation import generate
    from rdepth.model.noise import StateNoise

    _one_mode("generate_call", controller_factory, loop_counts)
    if new_tokens < 1 or prompt.shape[1] + new_tokens > model.config.block_size:
        raise RdepthError(
            f"generate_call: need 1 <= new_tokens and prompt + new tokens <= block size {model.config.block_size}"
        )
    device = prompt.device
    noise = StateNoise(seed, range(prompt.shape[0]))

    @torch.no_grad()
    def call() -> None:
        with _autocast(device, autocast_dtype):
            generate(model, prompt, new_tokens, temperature=0.0, loop_counts=loop_counts,
                     controller_factory=controller_factory, noise=noise)

    return call


def _timed(call: Call, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_interleaved(
    calls: Mapping[str, Call],
    device: torch.device | str,
    *,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``calls``, measured interleaved.

    Each call is warmed up ``warmup`` times (untimed); then ``repeats`` rounds
    each time every call once, between device synchronisations, in an order
    shuffled per round (seeded by ``seed``). Returns label -> the ``repeats``
    samples in round order. ``progress(round)`` is called after each round.
    """
    if warmup < 0 or repeats < 1:
        raise RdepthError(f"timing: need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    device = torch.device(device)
    labels = list(calls)
    for label in labels:
        for _ in range(warmup):
            calls[label]()
    order = random.Random(seed)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(repeats):
        shuffled = labels[:]
        order.shuffle(shuffled)
        for label in shuffled:
            samples[label].append(_timed(calls[label], device))
        if progress is not None:
            progress(round_index)
    return samples

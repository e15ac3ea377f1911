"""What a client hands the engine (:class:`Request`) and what it gets back (:class:`Finished`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rdepth.errors import RdepthError


@dataclass
class Request:
    """One sequence to decode.

    ``prompt``: token ids (at least one); each runs through the model a position at a time, under the
    engine's budget or exit rule, as :meth:`rdepth.model.decoder.Decoder.extend` runs a prompt. Then up to
    ``max_tokens`` new tokens (>= 1), each chosen from the logits of the position before: greedy at
    ``temperature`` 0, else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k``
    largest and the smallest set whose probability reaches ``top_p``, from a generator seeded with
    ``seed`` (the request's own: the draws do not depend on what else shares the batch). A token in
    ``stop`` ends the request after it is emitted. The initial loop states are the ones
    ``StateNoise(noise_seed, [sequence_id])`` gives (the batch-1 decoder's default is seed 0, id 0).
    ``keep_logits`` keeps every position's logits (``[T, V]``, on the host) in the result.
    """

    prompt: Sequence[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    stop: Sequence[int] = ()
    noise_seed: int = 0
    sequence_id: int = 0
    keep_logits: bool = False
    tag: object = None  # the client's own label, handed back untouched

    def __post_init__(self) -> None:
        if isinstance(self.prompt, torch.Tensor):
            self.prompt = self.prompt.reshape(-1).tolist()
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise RdepthError("request: the prompt holds no token")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RdepthError(f"request: max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise RdepthError(f"request: temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RdepthError(f"request: top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise RdepthError(f"request: top_k must be an integer >= 1, got {self.top_k!r}")
        self.stop = frozenset(int(t) for t in self.stop)


@dataclass
class Finished:
    """A request's result.

    ``tokens``: the new tokens; ``steps`` ``[T + n][G]``: the loop steps each position ran per group (the
    prompt's positions first, then one per new token fed back); ``predicted``: the argmax after each
    prompt position (teacher-forced predictions, what scoring reads); ``finish_reason``: ``"length"``
    (max_tokens), ``"stop"`` (a stop token), ``"context"`` (the cache's capacity) or ``"error"`` (then
    ``error`` says why and the tokens so far stand); ``logits`` ``[T + n, V]`` with ``keep_logits``.
    ``rules``: per position and group, why its loop ended (``"rule"`` the exit rule fired, ``"budget"`` the
    cap or a fixed budget)."""

    request_id: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    rules: list[list[str]] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logits: torch.Tensor | None = None
    submitted_tick: int = 0
    finished_tick: int = 0
    submitted_s: float = 0.0
    finished_s: float = 0.0

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.submitted_s

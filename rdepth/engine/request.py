"""What a client hands the engine (:class:`Request`) and what it gets back (:class:`Finished`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rdepth.errors import RdepthError


@dataclass(frozen=True)
class Depth:
    """A request's own loop depth, in place of the engine's budget or rule: ``loops`` (a fixed budget: that many
    steps in every group), or ``rule`` (one of the rules the engine was built to serve, by name) at threshold
    ``tau`` (None: the rule's as the engine built it), each group's loop capped at ``k_max`` steps (None: the
    engine's cap). Its tokens are those of its batch-1 decode at that budget or rule, whatever shares the batch."""

    loops: int | None = None
    rule: str | None = None
    tau: float | None = None
    k_max: int | None = None

    def __post_init__(self) -> None:
        if (self.loops is None) == (self.rule is None):
            raise RdepthError("request: a depth gives loops or a rule, one of the two")
        for name in ("loops", "k_max"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RdepthError(f"request: depth {name} must be an integer >= 1, got {value!r}")
        if self.loops is not None and (self.tau is not None or self.k_max is not None):
            raise RdepthError("request: a depth of fixed loops takes no tau or k_max")
        if self.tau is not None and not (isinstance(self.tau, (int, float)) and not isinstance(self.tau, bool)
                                         and math.isfinite(self.tau) and self.tau > 0):
            raise RdepthError(f"request: depth tau must be a positive finite number, got {self.tau!r}")

    def describe(self) -> dict:
        """The depth as a report echoes it."""
        if self.loops is not None:
            return {"loops": self.loops}
        return {"exit": self.rule, "tau": self.tau, "k_max": self.k_max}


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
    ``StateNoise(noise_seed, [sequence_id])`` gives (the batch-1 decoder's default is seed 0, id 0). ``depth``
    (a :class:`Depth`): the request's own loop budget or exit rule, in the same batch as the others'.
    ``keep_logits`` keeps every position's logits (``[T, V]``, on the host) in the result. ``logprobs``: for
    every new token, its log-probability and the ``logprobs`` most likely tokens' (:class:`TokenLogprob`, from
    the model's logits, before temperature and top-p); with ``prompt_logprobs`` too, for every prompt token
    after the first (what scoring reads).
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
    logprobs: int | None = None
    prompt_logprobs: bool = False
    depth: Depth | None = None  # the request's own budget or rule (None: the engine's)
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
        _check_logprobs(self.logprobs, self.prompt_logprobs)
        if self.depth is not None and not isinstance(self.depth, Depth):
            raise RdepthError(f"request: depth must be a Depth, got {type(self.depth).__name__}")


def _check_logprobs(logprobs, prompt_logprobs: bool) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise RdepthError(f"request: logprobs must be an integer >= 0 or None, got {logprobs!r}")
    if prompt_logprobs and logprobs is None:
        raise RdepthError("request: prompt_logprobs needs logprobs (the most likely tokens to keep)")


@dataclass
class TokenLogprob:
    """A token's log-probability under the logits of the position before it, and the ``k`` most likely tokens'
    (``top``: ``(token, logprob)``, most likely first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

    @classmethod
    def of(cls, logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
        """From one position's logits ``[V]`` (log-softmax in float32)."""
        scores = torch.log_softmax(logits.float(), dim=-1)
        values, ids = scores.topk(min(k, scores.shape[-1]))
        return cls(int(token), float(scores[token]), list(zip(ids.tolist(), values.tolist(), strict=True)))


@dataclass
class Finished:
    """A request's result.

    ``tokens``: the new tokens; ``steps`` ``[T + n][G]``: the loop steps each position ran per group (the
    prompt's positions first, then one per new token fed back); ``predicted``: the argmax after each
    prompt position (teacher-forced predictions, what scoring reads); ``finish_reason``: ``"length"``
    (max_tokens), ``"stop"`` (a stop token), ``"context"`` (the cache's capacity) or ``"error"`` (then
    ``error`` says why and the tokens so far stand); ``logits`` ``[T + n, V]`` with ``keep_logits``.
    ``rules``: per position and group, why its loop ended (``"rule"`` the exit rule fired, ``"budget"`` the
    cap or a fixed budget). With ``logprobs``: ``logprobs`` per new token and, with ``prompt_logprobs``,
    ``prompt_logprobs`` per prompt token after the first (:class:`TokenLogprob`). ``rounds``, ``drafted``,
    ``accepted``: its loop-speculation rounds, drafts made and drafts kept (an engine built with ``speculate``)."""

    request_id: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    rules: list[list[str]] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logits: torch.Tensor | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    submitted_tick: int = 0
    finished_tick: int = 0
    submitted_s: float = 0.0
    finished_s: float = 0.0
    rounds: int = 0  # loop speculation (Engine(speculate=K)): this request's rounds, drafts made and kept
    drafted: int = 0
    accepted: int = 0

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.submitted_s

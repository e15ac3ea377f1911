"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` as the engine's requests, or a
:class:`~rdepth.serve.errors.BadRequest` naming the field (OpenAI's error body, status 400).

Bodies are checked here rather than by pydantic models, so that a bad one gets one error body naming the
field, never a traceback. The cheap checks come first; tokenising, the costly part, last.

**Seeds.** A choice's tokens are its batch-1 decode, whatever else the request or the server holds: choice
``j`` of a prompt (``j < n``) runs with the seed ``seed + j`` when it samples (``temperature`` > 0), ``seed``
when it is greedy (so ``n`` greedy choices are one answer), whatever the prompt's place in a ``prompt``
list. That seed keys both its sampling generator and its initial loop states: ``StateNoise(--seed, [seed])``,
the batch-1 decoder's noise of sequence ``seed`` (seed 0: sequence 0, what ``rdepth generate`` and ``rdepth
lm-eval`` start from). A request without ``seed`` samples with a fresh one (drawn from the OS) and decodes
greedily with seed 0; each choice reports its seed in ``rdepth.seed``.

**Depth.** The body's ``rdepth`` object (:mod:`rdepth.serve.depth`) sets every choice's loop budget or exit
rule, within the server's bounds; each choice's report echoes the policy it ran.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from rdepth.engine import Depth, Request
from rdepth.errors import RdepthError
from rdepth.serve.chat import chat_messages
from rdepth.serve.errors import BadRequest
from rdepth.serve.served import CHARS_PER_POSITION, ServedModel

MAX_STOPS = 16  # stop strings per request (OpenAI takes 4; lm-eval sends a task's own and the end token's)
MAX_STOP_CHARS = 1024
SEED_BOUND = 2**62
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
          "logprobs", "presence_penalty", "frequency_penalty", "rdepth"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


@dataclass
class Settings:
    """What a response needs beyond the engine's requests: ``prompts`` (token ids, one per prompt), ``n``,
    ``max_tokens`` (0: score the prompt only, with ``echo``), ``logprobs`` (most likely tokens per position, or
    None), ``echo``, ``stops``, ``stream`` and ``include_usage``, each choice's ``seeds``, and the ``policy``
    every choice runs (its depth report echoes it)."""

    prompts: list[list[int]]
    n: int
    max_tokens: int
    logprobs: int | None
    echo: bool
    stops: list[str]
    stream: bool
    include_usage: bool
    seeds: list[int]
    policy: dict


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be in [{low:g}, {high:g}], got {value!r}", name)
    return value


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def _check_fields(served: ServedModel, body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.name:
        raise BadRequest(f"model '{model}' is not served here (this server serves '{served.name}')", "model",
                         404, "not_found_error")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for penalty in ("presence_penalty", "frequency_penalty"):
        if body.get(penalty) not in (None, 0, 0.0):
            raise BadRequest(f"'{penalty}' is not supported by this server (only 0)", penalty)
    return body


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them (each at most "
                         f"{MAX_STOP_CHARS} characters)", "stop")
    return stop


def _stream(body: dict) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``)."""
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only for a streamed request ('stream': true)", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("'stream_options' must be an object with 'include_usage' (true or false)", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options.include_usage' must be true or false", "stream_options")
    return stream, options.get("include_usage", False)


def _choice_count(served: ServedModel, body: dict, prompts: int) -> int:
    n = number(body, "n", 1, 1, served.max_n, integer=True)
    if prompts * n > served.max_choices:
        raise BadRequest(f"a request may ask for at most {served.max_choices} choices (prompts x n: "
                         f"--max-choices), this one asks for {prompts} x {n} = {prompts * n}",
                         "prompt" if prompts > served.max_choices else "n")
    return n


def _length_checked(served: ServedModel, text: str, param: str) -> str:
    limit = CHARS_PER_POSITION * served.context
    if len(text) > limit:
        raise BadRequest(f"a {param} of {len(text)} characters is longer than this server tokenises ({limit}: "
                         f"{CHARS_PER_POSITION} per position of the context of {served.context})", param)
    return text


def _fits(served: ServedModel, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise BadRequest(f"a {param} is empty after tokenisation", param)
    if len(ids) > served.context:
        raise BadRequest(f"a {param} of {len(ids)} tokens exceeds the model's context of {served.context}", param)
    return list(ids)


def prompt_items(prompt) -> list:
    """``prompt`` as a list of prompts, each a string or a list of token ids (not yet tokenised): ``prompt`` is
    a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be a string, a list of strings or token ids (not empty)", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    return prompt


def prompt_tokens(served: ServedModel, item) -> list[int]:
    """One prompt's token ids (a string encoded literally); a string longer than :data:`CHARS_PER_POSITION`
    characters per position of the context is refused before the tokenizer sees it, and so is one that is not
    valid Unicode (a lone surrogate) or holds a word outside a task model's vocabulary."""
    vocab = served.tokenizer.vocab_size
    if isinstance(item, str):
        _length_checked(served, item, "prompt")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("a prompt is not valid Unicode (it holds a lone surrogate)", "prompt") from None
        try:
            ids = served.tokenizer.encode(item)
        except RdepthError as exc:  # a task vocabulary refuses a word it lacks
            raise BadRequest(str(exc), "prompt") from None
    elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        ids = item
        if any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"'prompt' holds a token id outside the vocabulary [0, {vocab})", "prompt")
    else:
        raise BadRequest("'prompt' must be a string, a list of strings or token ids", "prompt")
    return _fits(served, ids, "prompt")


def _sampling(body: dict) -> tuple[float, float, int]:
    """``temperature``, ``top_p`` and the request's seed (see the module: a fresh one to sample without one)."""
    temperature = float(number(body, "temperature", 1.0, 0, 2))
    top_p = float(number(body, "top_p", 1.0, 1e-9, 1))
    seed = number(body, "seed", None, 0, SEED_BOUND, integer=True)
    if seed is None:
        seed = secrets.randbelow(SEED_BOUND) if temperature > 0 else 0
    return temperature, top_p, seed


def _depth(served: ServedModel, body: dict) -> tuple[Depth | None, dict]:
    """The body's ``rdepth`` object as every choice's depth, and the policy the choices run (see the module)."""
    if served.depths is None:
        if body.get("rdepth") is not None:
            raise BadRequest("this server takes no 'rdepth' object (it runs one policy for every request)", "rdepth")
        return None, served.policy
    return served.depths.read(body.get("rdepth"))


def _requests(served: ServedModel, prompts: list[list[int]], n: int, max_tokens: int, sampling: tuple,
              logprobs: int | None, echo: bool, depth: Depth | None) -> tuple[list[Request], list[int]]:
    """The engine's requests, prompt-major then choice, and each one's seed (see the module)."""
    temperature, top_p, seed = sampling
    requests, seeds = [], []
    for ids in prompts:
        for choice in range(n):
            own = seed + choice if temperature > 0 else seed
            requests.append(Request(ids, max_tokens=max(max_tokens, 1), temperature=temperature, top_p=top_p,
                                    seed=own, stop=served.end_tokens, noise_seed=served.noise_seed,
                                    sequence_id=own, logprobs=logprobs,
                                    prompt_logprobs=echo and logprobs is not None, depth=depth,
                                    tag=len(requests)))
            seeds.append(own)
    return requests, seeds


def parse_completion(served: ServedModel, body: Any) -> tuple[list[Request], Settings]:
    """A ``/v1/completions`` body: the engine's requests (prompt-major, then choice) and the response's
    settings, or :class:`BadRequest`."""
    body = _check_fields(served, body, COMPLETION_FIELDS)
    if body.get("best_of") not in (None, 1):
        raise BadRequest("'best_of' is not supported by this server (only 1)", "best_of")
    items = prompt_items(body.get("prompt"))
    n = _choice_count(served, body, len(items))
    echo = flag(body, "echo")
    max_tokens = number(body, "max_tokens", 16, 0, served.max_tokens, integer=True)
    if max_tokens == 0 and not echo:
        raise BadRequest("'max_tokens' 0 asks for no token: with 'echo' it scores the prompt", "max_tokens")
    logprobs = number(body, "logprobs", None, 0, served.max_logprobs, integer=True)
    stream, include_usage = _stream(body)
    if stream and echo and logprobs is not None:
        raise BadRequest("'logprobs' with 'echo' (the prompt's log-probabilities) is answered whole, not streamed: "
                         "send 'stream': false", "logprobs")
    stops, sampling, (depth, policy) = _stops(body), _sampling(body), _depth(served, body)
    prompts = [prompt_tokens(served, item) for item in items]  # the costly part, last: every cheap check first
    requests, seeds = _requests(served, prompts, n, max_tokens, sampling, logprobs, echo, depth)
    return requests, Settings(prompts, n, max_tokens, logprobs, echo, stops, stream, include_usage, seeds, policy)


def parse_chat(served: ServedModel, body: Any) -> tuple[list[Request], Settings]:
    """A ``/v1/chat/completions`` body (the model has a chat template: the caller checked), as
    :func:`parse_completion` does."""
    body = _check_fields(served, body, CHAT_FIELDS)
    messages = chat_messages(body.get("messages"))
    n = _choice_count(served, body, 1)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, limit, served.max_tokens, 1, served.max_tokens, integer=True)
    if not isinstance(body.get("logprobs", False), (bool, type(None))):
        raise BadRequest("'logprobs' must be true or false (the number of tokens is 'top_logprobs')", "logprobs")
    top = number(body, "top_logprobs", None, 0, served.max_logprobs, integer=True)
    if top is not None and not body.get("logprobs"):
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
    stream, include_usage = _stream(body)
    stops, sampling, (depth, policy) = _stops(body), _sampling(body), _depth(served, body)
    _length_checked(served, "".join(m["content"] for m in messages), "messages")
    text = served.chat.render(messages)
    try:
        ids = served.encoder.encode(text)
    except RdepthError as exc:
        raise BadRequest(str(exc), "messages") from None
    prompts = [_fits(served, ids, "messages")]
    requests, seeds = _requests(served, prompts, n, max_tokens, sampling, logprobs, False, depth)
    return requests, Settings(prompts, n, max_tokens, logprobs, False, stops, stream, include_usage, seeds, policy)

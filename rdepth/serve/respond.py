"""A request's choices through the engine to OpenAI's response body (:func:`complete`) or its server-sent
events (:func:`stream`), for ``/v1/completions`` (:class:`CompletionFormat`) and ``/v1/chat/completions``
(:class:`ChatFormat`).

Each request's choices share one :class:`~rdepth.serve.runner.Inbox` on the event loop: no thread waits for
a choice, the engine's thread posts a tick's events in one call. A request that ends early (its client gone,
an error) cancels its open choices in a ``finally``: the engine frees their slots at its next tick.
"""

from __future__ import annotations

import json
import time
import uuid

from rdepth.engine import Finished, Request
from rdepth.engine.request import TokenLogprob
from rdepth.serve.choice import Choice, prefix_offsets
from rdepth.serve.errors import BadRequest, error_json, internal_error
from rdepth.serve.parse import Settings
from rdepth.serve.runner import EngineFailed, Inbox

FLOOR = -9999.0  # a log-probability of -inf as JSON can carry it (a token the model rules out)


def _lp(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def _top(tokenizer, scored: TokenLogprob) -> dict[str, float]:
    """The most likely tokens' text and log-probability, the chosen token's too (OpenAI's ``top_logprobs``; of
    tokens with the same text, the likelier)."""
    top: dict[str, float] = {}
    for token, logprob in [*scored.top, (scored.token, scored.logprob)]:
        top.setdefault(tokenizer.decode([token]), _lp(logprob))
    return top


class CompletionFormat:
    """``/v1/completions``: ``text``, and ``logprobs`` as ``tokens``, ``token_logprobs``, ``top_logprobs`` and
    ``text_offset`` (with ``echo``, the prompt's tokens first: the first has no log-probability)."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs(self, served, choice: Choice, first: int = 0, last: int | None = None, prompt: bool = False):
        if not choice.wants_logprobs:
            return None
        tokenizer = served.tokenizer
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt:
            pieces, offsets = prefix_offsets(tokenizer, choice.prompt)
            for i, (piece, offset) in enumerate(zip(pieces, offsets, strict=True)):
                scored = choice.prompt_logprobs[i - 1] if 0 < i <= len(choice.prompt_logprobs) else None
                out["tokens"].append(piece)
                out["token_logprobs"].append(None if scored is None else _lp(scored.logprob))
                out["top_logprobs"].append(None if scored is None else _top(tokenizer, scored))
                out["text_offset"].append(offset)
        for i in range(first, len(choice.tokens) if last is None else last):
            scored = choice.logprobs[i]
            out["tokens"].append(tokenizer.decode([choice.tokens[i]]))
            out["token_logprobs"].append(_lp(scored.logprob))
            out["top_logprobs"].append(_top(tokenizer, scored))
            out["text_offset"].append(len(choice.prefix) + choice.offsets[i])
        return out

    def choice(self, served, choice: Choice) -> dict:
        return {"text": choice.prefix + choice.text, "index": choice.index,
                "logprobs": self.logprobs(served, choice, prompt=choice.echo), "finish_reason": choice.finish_reason,
                "rdepth": choice.depth()}

    def chunk(self, served, choice: Choice, text: str, first: int, last: int, finish: str | None) -> dict:
        return {"text": text, "index": choice.index, "logprobs": self.logprobs(served, choice, first, last)
                if last > first else None, "finish_reason": finish,
                "rdepth": choice.depth(first, last, final=finish is not None)}

    def opening(self, choice: Choice) -> dict | None:
        if not choice.prefix:
            return None
        return {"text": choice.prefix, "index": choice.index, "logprobs": None, "finish_reason": None,
                "rdepth": {"steps": [], "rules": []}}


class ChatFormat:
    """``/v1/chat/completions``: ``message`` (a chunk's ``delta``), and ``logprobs`` as ``content``: per token
    its text, log-probability, UTF-8 bytes and ``top_logprobs`` (the end token, which has no text, left out)."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def logprobs(self, served, choice: Choice, first: int = 0, last: int | None = None):
        if not choice.wants_logprobs:
            return None
        tokenizer = served.tokenizer

        def entry(token: int, logprob: float) -> dict:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

        content = []
        for i in range(first, len(choice.tokens) if last is None else last):
            if choice.tokens[i] not in served.end_tokens:
                scored = choice.logprobs[i]
                content.append({**entry(scored.token, scored.logprob),
                                "top_logprobs": [entry(token, logprob) for token, logprob in scored.top]})
        return {"content": content}

    def choice(self, served, choice: Choice) -> dict:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self.logprobs(served, choice), "finish_reason": choice.finish_reason,
                "rdepth": choice.depth()}

    def chunk(self, served, choice: Choice, text: str, first: int, last: int, finish: str | None) -> dict:
        return {"index": choice.index, "delta": {"content": text} if text or finish is None else {},
                "logprobs": self.logprobs(served, choice, first, last) if last > first else None,
                "finish_reason": finish, "rdepth": choice.depth(first, last, final=finish is not None)}

    def opening(self, choice: Choice) -> dict:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "rdepth": {"steps": [], "rules": []}}


def _start(served, requests: list[Request], settings: Settings):
    """Every request into the engine's queue, its events into one inbox; each with the choice it builds."""
    inbox = Inbox()
    submissions = [served.runner.submit(request, inbox, i) for i, request in enumerate(requests)]
    choices = [Choice(served, i, r.prompt, settings, settings.seeds[i]) for i, r in enumerate(requests)]
    return inbox, submissions, choices


def _cancel_open(runner, submissions, choices: list[Choice]) -> None:
    """Cancel every choice still decoding: the engine frees its slot at its next tick."""
    for submission, choice in zip(submissions, choices, strict=True):
        if not choice.done and not choice.cut:
            runner.cancel(submission)


def _usage(settings: Settings, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in settings.prompts)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def complete(served, requests: list[Request], settings: Settings, form) -> dict:
    """Every choice to its end, concurrently in the engine's batch; the response body."""
    runner = served.runner
    inbox, submissions, choices = _start(served, requests, settings)
    try:
        open_choices = len(choices)
        while open_choices:
            index, event = await inbox.get()
            if isinstance(event, EngineFailed):  # logged once, by the runner
                raise BadRequest(event.message, None, 500, "server_error")
            choice = choices[index]
            if isinstance(event, Finished):
                choice.finish(event)
                open_choices -= 1
            elif choice.add(event) and choice.cut:
                runner.cancel(submissions[index])
    finally:  # cancelled (the client left) or failed: no choice goes on decoding for nobody
        _cancel_open(runner, submissions, choices)
    return {"id": f"{form.prefix}-{uuid.uuid4().hex[:24]}", "object": form.object, "created": int(time.time()),
            "model": served.name, "choices": [form.choice(served, c) for c in choices],
            "usage": _usage(settings, choices)}


async def stream(served, requests: list[Request], settings: Settings, form):
    """Server-sent events in OpenAI's chunk format: per choice an opening chunk (the echoed prompt, or the
    chat's role), one chunk per new token (the text it releases, its depth and log-probabilities), a last chunk
    with the finish reason; with ``include_usage`` a chunk of the usage; then ``[DONE]``."""
    runner = served.runner
    ident, created = f"{form.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    inbox, submissions, choices = _start(served, requests, settings)

    def event(choices_body: list[dict], **extra) -> str:
        body = {"id": ident, "object": form.chunk_object, "created": created, "model": served.name,
                "choices": choices_body, **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        for choice in choices:
            opening = form.opening(choice)
            if opening is not None:
                yield event([opening])
        open_choices = len(choices)
        while open_choices:
            index, item = await inbox.get()
            if isinstance(item, EngineFailed):  # the status is sent already: the fault as the last event
                yield f"data: {error_json(BadRequest(item.message, None, 500, 'server_error')).decode()}\n\n"
                return
            choice = choices[index]
            if isinstance(item, Finished):
                choice.finish(item)
                open_choices -= 1
                end = len(choice.tokens)
                yield event([form.chunk(served, choice, choice.release(), end, end, choice.finish_reason)])
                continue
            first = len(choice.tokens)
            if not choice.add(item):
                continue  # the choice ended (a stop string, an end token): the rest is cut
            if choice.cut:
                runner.cancel(submissions[index])
            yield event([form.chunk(served, choice, choice.release(), first, first + 1, None)])
        if settings.include_usage:
            yield event([], usage=_usage(settings, choices))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status is sent already: the fault as the stream's last event
        yield f"data: {error_json(internal_error('a streamed completion', exc)).decode()}\n\n"
    finally:
        _cancel_open(runner, submissions, choices)

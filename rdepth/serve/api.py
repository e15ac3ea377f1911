"""The OpenAI-compatible HTTP API in front of an :class:`~rdepth.serve.runner.EngineRunner`.

FastAPI on Starlette, served by uvicorn: a maintained ASGI stack whose test client runs the app in-process
(tests need no socket), with server-sent events for streaming. Bodies are validated here rather than by
pydantic models so that a bad request gets OpenAI's error body (``{"error": {"message", "type", "param",
"code"}}``, status 400) naming the field, never a traceback; whatever else fails in a request is a 500 with
the same body (:mod:`rdepth.serve.errors`).

A hostile client is bounded before it costs much: the body's size before it is parsed (413), the choices a
request may ask for (prompts x n) and a string prompt's length in characters before it is tokenised; the
tokenising runs off the event loop; a client that leaves has its choices cancelled, streamed or not.

Every choice carries an extension field ``rdepth``: per new token, the loop steps each group ran
(``steps``) and why each group's loop stopped (``rules``: ``"rule"`` the exit rule fired, ``"budget"`` the
cap or a fixed budget), and their mean per group (``mean_steps``).
"""

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rdepth.engine import Finished, Request
from rdepth.errors import RdepthError
from rdepth.serve.body import decode_json, read_body, unless_client_leaves
from rdepth.serve.errors import BadRequest, error_json, internal_error
from rdepth.serve.runner import EngineFailed, EngineRunner, Submission, TokenEvent

FINISH = {"length": "length", "context": "length", "stop": "stop", "cancelled": "stop", "error": "error"}
# A string prompt longer than this many characters per position of the context is refused before it is
# tokenised: to fit, its tokens would average more than this many characters (English text runs about 4), and
# tokenising it would cost the server hundreds of bytes per character.
CHARS_PER_POSITION = 16


@dataclass
class ServedModel:
    """What the API serves: the name clients pass as ``model``, the tokenizer, the engine's runner and the
    limits the server sets (``max_tokens`` per request, ``max_n`` choices per prompt, ``max_choices`` choices
    per request (prompts x n), ``max_body_bytes`` per request body, the noise seed)."""

    name: str
    tokenizer: Any
    runner: EngineRunner
    context: int
    policy: dict
    max_tokens: int = 256
    max_n: int = 16
    noise_seed: int = 0
    max_choices: int = 64
    max_body_bytes: int = 4 * 1024 * 1024


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be in [{low:g}, {high:g}], got {value!r}", name)
    return value


def _prompt_items(prompt) -> list:
    """``prompt`` as a list of prompts, each a string or a list of token ids (not yet tokenised): ``prompt`` is
    a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be a string, a list of strings or token ids (not empty)", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    return prompt


def _tokens(served: ServedModel, item) -> list[int]:
    """One prompt's token ids; a string longer than :data:`CHARS_PER_POSITION` characters per position of the
    context is refused before the tokenizer sees it, and so is one that is not valid Unicode (a lone surrogate)
    or holds a word outside a task model's vocabulary."""
    vocab = served.tokenizer.vocab_size
    if isinstance(item, str):
        limit = CHARS_PER_POSITION * served.context
        if len(item) > limit:
            raise BadRequest(f"a prompt of {len(item)} characters is longer than this server tokenises ({limit}: "
                             f"{CHARS_PER_POSITION} per position of the context of {served.context})", "prompt")
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
    if not ids:
        raise BadRequest("a prompt is empty after tokenisation", "prompt")
    if len(ids) > served.context:
        raise BadRequest(f"a prompt of {len(ids)} tokens exceeds the model's context of {served.context}", "prompt")
    return list(ids)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    return stop


def parse_completion(served: ServedModel, body: Any) -> tuple[list[Request], dict]:
    """The engine's requests (prompt-major, then choice) and the response's settings, or :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.name:
        raise BadRequest(f"model '{model}' is not served here (this server serves '{served.name}')", "model",
                         404, "not_found_error")
    known = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "echo",
             "user", "logprobs", "stream_options", "best_of", "presence_penalty", "frequency_penalty"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for unsupported in ("logprobs", "best_of"):
        if body.get(unsupported) not in (None, 1 if unsupported == "best_of" else None):
            raise BadRequest(f"'{unsupported}' is not supported by this server", unsupported)
    for penalty in ("presence_penalty", "frequency_penalty"):
        if body.get(penalty) not in (None, 0, 0.0):
            raise BadRequest(f"'{penalty}' is not supported by this server (only 0)", penalty)
    items = _prompt_items(body.get("prompt"))
    n = _number(body, "n", 1, 1, served.max_n, integer=True)
    if len(items) * n > served.max_choices:
        raise BadRequest(f"a request may ask for at most {served.max_choices} choices (prompts x n: "
                         f"--max-choices), this one asks for {len(items)} x {n} = {len(items) * n}",
                         "prompt" if len(items) > served.max_choices else "n")
    max_tokens = _number(body, "max_tokens", 16, 1, served.max_tokens, integer=True)
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 1e-9, 1)
    seed = _number(body, "seed", 0, 0, 2**62, integer=True)
    for flag in ("stream", "echo"):
        if not isinstance(body.get(flag, False), bool):
            raise BadRequest(f"'{flag}' must be true or false", flag)
    stops = _stops(body)
    prompts = [_tokens(served, item) for item in items]  # the costly part, last: every cheap check first
    requests = []
    for index, ids in enumerate(prompts):
        for choice in range(n):
            number = index * n + choice
            requests.append(Request(ids, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                                    seed=seed + number, noise_seed=served.noise_seed, sequence_id=number,
                                    tag=number))
    settings = {"stream": body.get("stream", False), "echo": body.get("echo", False), "stops": stops,
                "n": n, "prompts": prompts}
    return requests, settings


class Choice:
    """One choice's text as its tokens come: stop strings cut it, the depth report grows."""

    def __init__(self, served: ServedModel, index: int, prompt: list[int], stops: list[str], echo: bool):
        self.served, self.index, self.prompt, self.stops = served, index, prompt, stops
        self.tokens: list[int] = []
        self.steps: list[list[int]] = []
        self.rules: list[list[str]] = []
        self.prefix = served.tokenizer.decode(prompt) if echo else ""
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.finish_reason: str | None = None
        self.error: str | None = None

    def add(self, event: TokenEvent) -> None:
        if self.finish_reason is not None:
            return
        self.tokens.append(event.token)
        self.steps.append(event.steps)
        self.rules.append(event.rules)
        self.text = self.served.tokenizer.decode(self.tokens)
        for stop in self.stops:
            cut = self.text.find(stop)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"

    def finish(self, done: Finished) -> None:
        if self.finish_reason is None:
            self.finish_reason = FINISH.get(done.finish_reason, done.finish_reason)
        self.error = done.error

    def depth(self, first: int = 0) -> dict:
        steps = self.steps[first:]
        groups = len(steps[0]) if steps else 0
        report = {"steps": steps, "rules": self.rules[first:]}
        if first == 0:
            report["mean_steps"] = [sum(s[g] for s in steps) / len(steps) for g in range(groups)] if steps else []
            report["policy"] = self.served.policy
        if self.error:
            report["error"] = self.error
        return report

    def body(self) -> dict:
        return {"text": self.prefix + self.text, "index": self.index, "logprobs": None,
                "finish_reason": self.finish_reason, "rdepth": self.depth()}


async def _next_event(submission: Submission):
    return await asyncio.get_running_loop().run_in_executor(None, submission.events.get)


def _submit(served: ServedModel, requests: list[Request], settings: dict) -> tuple[list[Submission], list[Choice]]:
    """Every request into the engine's queue, each with the choice its tokens build."""
    submissions = [served.runner.submit(request) for request in requests]
    choices = [Choice(served, i, r.prompt, settings["stops"], settings["echo"]) for i, r in enumerate(requests)]
    return submissions, choices


def _parse(served: ServedModel, raw: bytes) -> tuple[list[Request], dict]:
    return parse_completion(served, decode_json(raw))


def _cancel_open(runner: EngineRunner, submissions: list[Submission], choices: list[Choice]) -> None:
    """Cancel every choice still decoding (neither finished nor cut by a stop string): its slot is freed at its
    next token."""
    for submission, choice in zip(submissions, choices, strict=False):
        if choice.finish_reason is None:
            runner.cancel(submission)


async def complete(served: ServedModel, requests: list[Request], settings: dict) -> dict:
    """Every choice to its end, concurrently in the engine's batch; the response body."""
    runner = served.runner
    submissions, choices = _submit(served, requests, settings)

    async def drain(submission: Submission, choice: Choice) -> None:
        while True:
            event = await _next_event(submission)
            if isinstance(event, EngineFailed):  # logged once, by the runner
                raise BadRequest(event.message, None, 500, "server_error")
            if isinstance(event, Finished):
                choice.finish(event)
                return
            stopped = choice.finish_reason is not None
            choice.add(event)
            if choice.finish_reason is not None and not stopped:
                runner.cancel(submission)

    tasks = [asyncio.ensure_future(drain(s, c)) for s, c in zip(submissions, choices, strict=False)]
    try:
        await asyncio.gather(*tasks)
    finally:  # cancelled (the client left) or failed: no choice goes on decoding for nobody
        for task in tasks:
            task.cancel()
        _cancel_open(runner, submissions, choices)
    prompt_tokens = sum(len(p) for p in settings["prompts"])
    completion = sum(len(c.tokens) for c in choices)
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": served.name, "choices": [c.body() for c in choices],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


async def stream(served: ServedModel, requests: list[Request], settings: dict):
    """Server-sent events in OpenAI's chunk format: one chunk per new token of any choice (its text delta and
    depth), a last chunk per choice with its finish reason, then ``[DONE]``."""
    runner = served.runner
    ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    submissions, choices = _submit(served, requests, settings)
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        while True:
            event = await _next_event(submissions[index])
            await merged.put((index, event))
            if isinstance(event, (Finished, EngineFailed)):
                return

    tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]

    def chunk(choice: Choice, text: str, depth: dict, finish: str | None) -> str:
        body = {"id": ident, "object": "text_completion", "created": created, "model": served.name,
                "choices": [{"text": text, "index": choice.index, "logprobs": None, "finish_reason": finish,
                             "rdepth": depth}]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        for choice in choices:
            if choice.prefix:
                yield chunk(choice, choice.prefix, {"steps": [], "rules": []}, None)
        open_choices = len(choices)
        while open_choices:
            index, event = await merged.get()
            choice = choices[index]
            if isinstance(event, EngineFailed):  # the status is sent already: the fault as the last event
                yield f"data: {error_json(BadRequest(event.message, None, 500, 'server_error')).decode()}\n\n"
                return
            if isinstance(event, Finished):
                choice.finish(event)
                open_choices -= 1
                end = {"steps": [], "rules": [], **({"error": choice.error} if choice.error else {})}
                yield chunk(choice, "", end, choice.finish_reason)
                continue
            if choice.finish_reason is not None:
                continue  # a stop string matched: the rest is cut
            first = len(choice.tokens)
            choice.add(event)
            if choice.finish_reason is not None:
                runner.cancel(submissions[index])
            delta = choice.text[choice.sent:]
            choice.sent = len(choice.text)
            yield chunk(choice, delta, choice.depth(first), None)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status is sent already: the fault as the stream's last event
        yield f"data: {error_json(internal_error('a streamed completion', exc)).decode()}\n\n"
    finally:
        for task in tasks:
            task.cancel()
        _cancel_open(runner, submissions, choices)


def prometheus(served: ServedModel) -> str:
    """The runner's counters in Prometheus' text format."""
    m = served.runner.snapshot()
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP rdepth_{name} {help_text}")
        lines.append(f"# TYPE rdepth_{name} {kind}")
        for labels, value in samples:
            lines.append(f"rdepth_{name}{labels} {value:g}" if isinstance(value, float) else
                         f"rdepth_{name}{labels} {value}")

    metric("requests_total", "counter", "requests finished (choices)", [("", m["requests"])])
    metric("requests_failed_total", "counter", "requests that ended with an error", [("", m["requests_failed"])])
    metric("tokens_generated_total", "counter", "new tokens chosen", [("", m["tokens_generated"])])
    metric("positions_total", "counter", "positions decoded (prompt and fed-back tokens)", [("", m["positions"])])
    metric("ticks_total", "counter", "engine ticks (one batched call per stage each)", [("", m["ticks"])])
    metric("queue_length", "gauge", "requests waiting for a slot", [("", m["queue"])])
    metric("batch_occupancy", "gauge", "slots in use over the batch width, now", [("", m["in_flight"] / m["batch"])])
    metric("batch_occupancy_mean", "gauge", "mean slots in use per tick over the batch width",
           [("", m["occupied_slot_ticks"] / (m["ticks"] * m["batch"]) if m["ticks"] else 0.0)])
    metric("mean_loop_steps", "gauge", "loop steps executed per position, per group",
           [(f'{{group="{g}"}}', s / m["positions"] if m["positions"] else 0.0) for g, s in enumerate(m["loop_steps"])])
    metric("tokens_per_second", "gauge", "new tokens per second since the server started",
           [("", m["tokens_generated"] / m["uptime_s"] if m["uptime_s"] > 0 else 0.0)])
    return "\n".join(lines) + "\n"


def build_app(served: ServedModel):
    """The FastAPI application (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/metrics``)."""
    # (no ``from __future__ import annotations`` in this module: FastAPI reads the endpoints' annotations, and
    # HttpRequest is local to this function)
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    app = FastAPI(title="rdepth", description="An OpenAI-compatible server whose every token reports its depth")
    # Parsing and tokenising, off the event loop (a long prompt must not stall every other client) and off the
    # loop's default executor (whose threads wait on the engine's events).
    parsing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rdepth-parse")

    def failure(error: BadRequest) -> Response:
        return Response(error_json(error), status_code=error.status, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        try:
            raw = await read_body(http, served.max_body_bytes)
            requests, settings = await asyncio.get_running_loop().run_in_executor(parsing, _parse, served, raw)
            if settings["stream"]:
                return StreamingResponse(stream(served, requests, settings), media_type="text/event-stream")
            answered, body = await unless_client_leaves(http, complete(served, requests, settings))
            if not answered:  # nobody to answer: its choices were cancelled
                return Response(status_code=499)
            return JSONResponse(body)
        except BadRequest as error:
            return failure(error)
        except Exception as exc:
            return failure(internal_error("a completion", exc))

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        if getattr(served.tokenizer, "chat_template", None) is None:
            return failure(BadRequest(f"model '{served.name}' has no chat template (its tokenizer "
                                      f"{getattr(served.tokenizer, 'name', '')!s} defines none): use /v1/completions",
                                      None, 404, "not_found_error"))
        return failure(BadRequest("chat templates are not implemented by this server", None, 404, "not_found_error"))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model",
                                            "created": int(served.runner.started_s), "owned_by": "rdepth",
                                            "rdepth": {"policy": served.policy, "batch": served.runner.engine.batch,
                                                       "context": served.context,
                                                       "kv_layout": served.runner.engine.kv_layout}}]}

    @app.get("/health")
    async def health():
        status = {"status": "ok" if served.runner.failure is None else "failed",
                  "in_flight": served.runner.engine.in_flight(), "queue": served.runner.queue_length()}
        return JSONResponse(status, status_code=200 if served.runner.failure is None else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(served), media_type="text/plain; version=0.0.4")

    return app

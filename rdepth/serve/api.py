"""The OpenAI-compatible HTTP API in front of an :class:`~rdepth.serve.runner.EngineRunner`.

FastAPI on Starlette, served by uvicorn: a maintained ASGI stack whose test client runs the app in-process
(tests need no socket), with server-sent events for streaming. Bodies are validated by
:mod:`rdepth.serve.parse` rather than by pydantic models so that a bad request gets OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``, status 400) naming the field, never a traceback; whatever
else fails in a request is a 500 with the same body (:mod:`rdepth.serve.errors`).

A hostile client is bounded before it costs much: the body's size before it is parsed (413), the choices a
request may ask for (prompts x n) and a string prompt's length in characters before it is tokenised; the
tokenising runs off the event loop; a client that leaves has its choices cancelled, streamed or not.

Every choice carries an extension field ``rdepth``: per new token, the loop steps each group ran
(``steps``) and why each group's loop stopped (``rules``: ``"rule"`` the exit rule fired, ``"budget"`` the
cap or a fixed budget), their mean per group (``mean_steps``), the policy it ran (the server's, or the one its
request's ``rdepth`` object asked for: :mod:`rdepth.serve.depth`) and the choice's seed.

Besides OpenAI's endpoints, ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` answer as vLLM's do: what
lm-eval's ``local-completions`` model reads when it takes the server's tokenizer (``tokenizer_backend=remote``).
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rdepth.errors import RdepthError
from rdepth.serve.body import decode_json, read_body, unless_client_leaves
from rdepth.serve.errors import BadRequest, error_json, internal_error
from rdepth.serve.metrics import prometheus
from rdepth.serve.parse import parse_chat, parse_completion
from rdepth.serve.respond import ChatFormat, CompletionFormat, complete, stream
from rdepth.serve.served import CHARS_PER_POSITION, ServedModel

__all__ = ["CHARS_PER_POSITION", "ServedModel", "build_app", "prometheus"]


def model_card(served: ServedModel) -> dict:
    """The served model as ``/v1/models`` lists it."""
    return {"id": served.name, "object": "model", "created": int(served.runner.started_s), "owned_by": "rdepth",
            "max_model_len": served.context,
            "rdepth": {"policy": served.policy, "batch": served.runner.engine.batch, "context": served.context,
                       "kv_layout": served.runner.engine.kv_layout, "chat_template": served.chat is not None,
                       "max_logprobs": served.max_logprobs,
                       "depths": served.depths.card() if served.depths is not None else None}}


def tokenize(served: ServedModel, body: Any) -> dict:
    """``/tokenize``: ``{"prompt": TEXT}`` -> its ids, special tokens' text read as them (as a Hugging Face
    tokenizer reads it, and as lm-eval asks for the end token's id)."""
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise BadRequest("/tokenize takes {'prompt': TEXT}", "prompt")
    if body.get("model") not in (None, served.name):
        raise BadRequest(f"model '{body['model']}' is not served here (this server serves '{served.name}')",
                         "model", 404, "not_found_error")
    text = body["prompt"]
    limit = CHARS_PER_POSITION * served.context
    if len(text) > limit:
        raise BadRequest(f"a prompt of {len(text)} characters is longer than this server tokenises ({limit})",
                         "prompt")
    try:
        ids = served.encoder.encode(text)
    except (UnicodeEncodeError, TypeError):
        raise BadRequest("the prompt is not valid Unicode (it holds a lone surrogate)", "prompt") from None
    except RdepthError as exc:  # a task vocabulary refuses a word it lacks
        raise BadRequest(str(exc), "prompt") from None
    return {"count": len(ids), "max_model_len": served.context, "tokens": ids, "token_strs": None}


def detokenize(served: ServedModel, body: Any) -> dict:
    """``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": TEXT}``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = served.tokenizer.vocab_size
    if not isinstance(tokens, list) or len(tokens) > CHARS_PER_POSITION * served.context or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise BadRequest(f"/detokenize takes {{'tokens': [ids]}}, ids in [0, {vocab})", "tokens")
    return {"prompt": served.tokenizer.decode(tokens)}


def tokenizer_info(served: ServedModel) -> dict:
    eot = getattr(served.tokenizer, "eot_id", None)
    template = served.chat.template if served.chat is not None else None
    return {"tokenizer_class": getattr(served.tokenizer, "name", type(served.tokenizer).__name__),
            "eos_token": served.tokenizer.decode([eot]) if eot is not None else None,
            "bos_token": template.bos_token if template else None, "pad_token": None,
            "chat_template": template.chat_template if template else None, "model_max_length": served.context,
            "vocab_size": served.tokenizer.vocab_size}


def build_app(served: ServedModel):
    """The FastAPI application (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/metrics``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``)."""
    # (no ``from __future__ import annotations`` in this module: FastAPI reads the endpoints' annotations, and
    # HttpRequest is local to this function)
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    app = FastAPI(title="rdepth", description="An OpenAI-compatible server whose every token reports its depth")
    # Parsing and tokenising, off the event loop (a long prompt must not stall every other client).
    parsing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rdepth-parse")

    def failure(error: BadRequest) -> Response:
        return Response(error_json(error), status_code=error.status, media_type="application/json")

    async def parsed(http: HttpRequest, parse):
        raw = await read_body(http, served.max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(parsing, lambda: parse(served, decode_json(raw)))

    async def answer(http: HttpRequest, parse, form):
        try:
            requests, settings = await parsed(http, parse)
            if settings.stream:
                return StreamingResponse(stream(served, requests, settings, form), media_type="text/event-stream")
            answered, body = await unless_client_leaves(http, complete(served, requests, settings, form))
            if not answered:  # nobody to answer: its choices were cancelled
                return Response(status_code=499)
            return JSONResponse(body)
        except BadRequest as error:
            return failure(error)
        except Exception as exc:
            return failure(internal_error("a completion", exc))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await answer(http, parse_completion, CompletionFormat())

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        if served.chat is None:
            return failure(BadRequest(f"model '{served.name}' has no chat template (its tokenizer "
                                      f"{getattr(served.tokenizer, 'name', '')!s} defines none): use /v1/completions",
                                      "model", 404, "not_found_error"))
        return await answer(http, parse_chat, ChatFormat())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != served.name:
            return failure(BadRequest(f"model '{model_id}' is not served here (this server serves '{served.name}')",
                                      "model", 404, "not_found_error"))
        return model_card(served)

    @app.get("/health")
    async def health():
        status = {"status": "ok" if served.runner.failure is None else "failed",
                  "in_flight": served.runner.engine.in_flight(), "queue": served.runner.queue_length()}
        return JSONResponse(status, status_code=200 if served.runner.failure is None else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(served), media_type="text/plain; version=0.0.4")

    async def tokenizer_call(http: HttpRequest, work):
        try:
            return JSONResponse(await parsed(http, work))
        except BadRequest as error:
            return failure(error)
        except Exception as exc:
            return failure(internal_error("a tokenizer request", exc))

    @app.post("/tokenize")
    async def tokenize_text(http: HttpRequest):
        return await tokenizer_call(http, tokenize)

    @app.post("/detokenize")
    async def detokenize_ids(http: HttpRequest):
        return await tokenizer_call(http, detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer():
        return tokenizer_info(served)

    return app

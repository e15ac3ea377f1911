"""A request's body under hostile clients: its size bounded before anything is parsed, its JSON parsed with
every way that fails a 400, and the client's departure noticed while its answer is being decoded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rdepth.serve.errors import BadRequest


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"the request body is larger than this server takes ({limit} bytes: --max-body-bytes)",
                      None, 413)


async def read_body(http, limit: int) -> bytes:
    """The body of ``http`` (a Starlette request), at most ``limit`` bytes: a declared ``Content-Length``
    above it is refused before a byte is read, a streamed (chunked) body as soon as it passes it."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit)
    from starlette.requests import ClientDisconnect

    body = bytearray()
    try:
        async for chunk in http.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:  # nobody to answer; nothing to log
        raise BadRequest("the client left before its body was read", None, 499) from None
    return bytes(body)


def decode_json(raw: bytes) -> Any:
    """``raw`` as JSON; invalid JSON, text that is not UTF-8 and nesting deeper than the parser recurses are
    the client's fault."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the body nests too deeply to parse") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest("the body is not valid JSON") from None


async def client_left(http) -> None:
    """Returns when the client of ``http`` disconnects (after its body was read: the server's next message
    from the client is ``http.disconnect``, or it never comes while the connection stays open)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(http, work) -> tuple[bool, Any]:
    """``(True, result)`` of the coroutine ``work``, or ``(False, None)`` as soon as the client of ``http``
    leaves: then ``work`` is cancelled and awaited (what it holds released in its ``finally``)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(client_left(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return False, None
    return True, task.result()

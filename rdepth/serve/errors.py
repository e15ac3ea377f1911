"""What goes wrong in a request, as OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``.

A client's fault (:class:`BadRequest`) is 4xx and logged by nobody: a hostile or careless client must not fill
the server's log with tracebacks. Anything else raised while a request is handled is the server's own fault:
500 with the same body shape, and one traceback in the log (:func:`internal_error`)."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("rdepth.serve")


class BadRequest(Exception):
    """A request the server refuses: ``status`` 400 unless said otherwise, ``param`` the field to blame."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(error: BadRequest) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


def error_json(error: BadRequest) -> bytes:
    """The body as ASCII JSON: a message that quotes the client's text (a model name, a field) may hold a lone
    surrogate, which UTF-8 cannot encode; escaped, it is valid JSON all the same."""
    return json.dumps(error_body(error), ensure_ascii=True).encode("ascii")


def internal_error(where: str, exc: BaseException) -> BadRequest:
    """A 500 for an exception nobody expected: its traceback to the log once, a message naming its type to the
    client (never the traceback)."""
    log.error("%s failed", where, exc_info=(type(exc), exc, exc.__traceback__))
    return BadRequest(f"the server failed on this request ({type(exc).__name__}); its log has the details",
                      None, 500, "server_error")

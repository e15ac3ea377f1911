"""User-facing errors.

Anything a user can cause (a bad flag, a missing corpus, a corrupt checkpoint)
raises :class:`RdepthError`. The command line turns it into one line on stderr
and a non-zero exit; library callers can catch it like any exception.
"""


class RdepthError(Exception):
    """An error caused by the user's input, reported as a single line."""


# What a collective (gloo) raises on the surviving ranks when another rank of the run dies.
LOST_PEER_MARKS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer(exc: BaseException) -> str | None:
    """The one-line reason when ``exc`` is a collective failing because another rank died, else None."""
    if not isinstance(exc, RuntimeError):
        return None
    text = " ".join(str(exc).split())
    mark = next((m for m in LOST_PEER_MARKS if m in text), None)
    if mark is None:
        return None
    return f"another rank of this run died (the collective failed: {mark}); this rank stops too"


def check_utf8(what: str, text: str) -> str:
    """``text`` unchanged when it is valid Unicode; a one-line error naming the byte offset otherwise.

    Python decodes command-line arguments with ``surrogateescape``, so bytes that are not UTF-8
    arrive as lone surrogates, which tokenizers and file formats reject with a traceback.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)
        try:
            raw.decode("utf-8")
            offset = None
        except UnicodeDecodeError as exc:
            offset = exc.start
        where = f" at byte offset {offset} (0x{raw[offset]:02x})" if offset is not None else ""
        raise RdepthError(f"{what} is not valid UTF-8{where}") from None

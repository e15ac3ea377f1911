"""User-facing errors.

Anything a user can cause (a bad flag, a missing corpus, a corrupt checkpoint)
raises :class:`RdepthError`. The command line turns it into one line on stderr
and a non-zero exit; library callers can catch it like any exception.
"""


class RdepthError(Exception):
    """An error caused by the user's input, reported as a single line."""


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

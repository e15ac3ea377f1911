"""User-facing errors.

Anything a user can cause (a bad flag, a missing corpus, a corrupt checkpoint)
raises :class:`RdepthError`. The command line turns it into one line on stderr
and a non-zero exit; library callers can catch it like any exception.
"""


class RdepthError(Exception):
    """An error caused by the user's input, reported as a single line."""

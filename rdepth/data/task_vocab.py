"""The one small vocabulary every built-in task writes its problems in.

Tokens (ids in this order, 42 in all)::

    0      <eot>   separator between problems (the document separator of the shards)
    1..5   ? = > ; +   query, answer/assignment, arrow, statement end, sum markers
    6..15  0 .. 9      digits
    16..41 a .. z      symbols (nodes, variable names)

The readable form of a problem is its token names joined by spaces, so
``encode`` splits text on whitespace and ``decode`` joins names with single
spaces: ``decode(encode(text)) == " ".join(text.split())``.

:class:`TaskVocab` has the attributes and methods of the project's
``Tokenizer`` protocol (``name``, ``vocab_size``, ``eot_id``, ``encode``,
``encode_batch``, ``decode``, ``save``), so a task-data folder opens like any
prepared corpus. ``save`` writes ``tokenizer_meta.json`` with
``{"spec": "task:NAME", "kind": "task", "tokens": [...]}``;
:func:`load_task_vocab` rebuilds it and refuses a token list that differs
from this module's (data written with another vocabulary).
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.io import write_json

META_FILE = "tokenizer_meta.json"  # the same file name rdepth.data.tokenizers uses
VOCAB_KIND = "task"
SPEC_PREFIX = "task:"

EOT = "<eot>"
QUERY, EQUALS, ARROW, END, PLUS = "?", "=", ">", ";", "+"
DIGITS = tuple(string.digits)
SYMBOLS = tuple(string.ascii_lowercase)
TOKENS: tuple[str, ...] = (EOT, QUERY, EQUALS, ARROW, END, PLUS) + DIGITS + SYMBOLS
TOKEN_IDS: dict[str, int] = {token: index for index, token in enumerate(TOKENS)}

EOT_ID = TOKEN_IDS[EOT]
QUERY_ID = TOKEN_IDS[QUERY]
EQUALS_ID = TOKEN_IDS[EQUALS]
PLUS_ID = TOKEN_IDS[PLUS]
DIGIT_IDS: tuple[int, ...] = tuple(TOKEN_IDS[d] for d in DIGITS)
SYMBOL_IDS: tuple[int, ...] = tuple(TOKEN_IDS[s] for s in SYMBOLS)


def digit_value(token: int) -> int | None:
    """The digit a token id stands for, or None when it is not a digit."""
    value = token - DIGIT_IDS[0]
    return value if 0 <= value < len(DIGIT_IDS) else None


def is_symbol(token: int) -> bool:
    return SYMBOL_IDS[0] <= token <= SYMBOL_IDS[-1]


class TaskVocab:
    """The task vocabulary as a tokenizer; ``name`` is the data spec (``task:chase``)."""

    vocab_size = len(TOKENS)
    eot_id = EOT_ID

    def __init__(self, name: str = "task:chase"):
        if not isinstance(name, str) or not name.startswith(SPEC_PREFIX) or name == SPEC_PREFIX:
            raise RdepthError(f"task vocabulary name must look like task:NAME, got {name!r}")
        self.name = name

    def encode(self, text: str) -> list[int]:
        """Whitespace-separated token names -> ids; RdepthError naming an unknown token."""
        ids = []
        for word in text.split():
            if word not in TOKEN_IDS:
                raise RdepthError(f"{word!r} is not a token of the task vocabulary")
            ids.append(TOKEN_IDS[word])
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> token names joined by spaces; RdepthError for an id outside the vocabulary."""
        names = []
        for token in ids:
            token = int(token)
            if not 0 <= token < len(TOKENS):
                raise RdepthError(f"token id {token} is outside the task vocabulary (size {len(TOKENS)})")
            names.append(TOKENS[token])
        return " ".join(names)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / META_FILE, {"spec": self.name, "kind": VOCAB_KIND, "tokens": list(TOKENS)})

    def __repr__(self) -> str:
        return f"TaskVocab({self.name!r}, vocab_size={self.vocab_size})"


def load_task_vocab(directory: str | os.PathLike) -> TaskVocab:
    """Rebuild the vocabulary that ``TaskVocab.save(directory)`` wrote."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise RdepthError(f"missing tokenizer file {path}")
    try:
        meta = json.loads(path.read_text())
        spec, kind, tokens = meta["spec"], meta["kind"], meta["tokens"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RdepthError(f"corrupt task vocabulary file {path}") from None
    if kind != VOCAB_KIND:
        raise RdepthError(f"{path} describes a {kind!r} tokenizer, not a task vocabulary")
    if list(tokens) != list(TOKENS):
        raise RdepthError(f"{path}: its token list differs from this version's task vocabulary")
    return TaskVocab(spec)

"""Sentences -> padded token batches, for every text teacher.

Every sentence encoder (:class:`TextTokenizer` for a ``tokenizer.json``,
:class:`rdepth.surrogate.teachers.rdepth_teacher.RdepthTextTokenizer` for an rdepth run)
has ``token_counts(sentences)`` and ``encode(sentences) -> TextBatch``;
:func:`text_batches` cuts a sentence list into length-bucketed batches with either.

The MiniLM ``tokenizer.json`` pads every input to 128 tokens; :class:`TextTokenizer`
turns that padding off and pads each batch itself, returning the attention mask beside the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rdepth.errors import RdepthError


@dataclass
class TextBatch:
    """ids (B, T) int64; mask (B, T) bool, True on real tokens (padding is on the right)."""

    ids: torch.Tensor
    mask: torch.Tensor


def pad_batch(sequences: list[list[int]]) -> TextBatch:
    """Token id lists -> a right-padded :class:`TextBatch` (pad id 0, masked out)."""
    length = max(1, max(len(ids) for ids in sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = True
    if not mask[:, 0].all():
        raise RdepthError("a sentence encoded to zero tokens")
    return TextBatch(ids, mask)


class TextTokenizer:
    """Wraps a directory's ``tokenizer.json`` (the ``tokenizers`` library), padding disabled."""

    def __init__(self, directory: Path, max_length: int) -> None:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise RdepthError(f"{directory} has no tokenizer.json (needed to encode the sentences)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise RdepthError(f"{path} could not be read ({type(exc).__name__})") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)
        self.max_length = max_length

    def token_counts(self, sentences: list[str]) -> list[int]:
        return [len(encoding.ids) for encoding in self.tokenizer.encode_batch(sentences)]

    def encode(self, sentences: list[str]) -> TextBatch:
        return pad_batch([encoding.ids for encoding in self.tokenizer.encode_batch(sentences)])


def text_batches(tokenizer, sentences: list[str], batch_size: int) -> list:
    """Length-bucketed (ids, mask, None) batches: sentences sorted by token count, then cut."""
    lengths = tokenizer.token_counts(sentences)
    order = sorted(range(len(sentences)), key=lambda i: (lengths[i], i))
    batches = []
    for begin in range(0, len(order), batch_size):
        encoded = tokenizer.encode([sentences[i] for i in order[begin:begin + batch_size]])
        batches.append((encoded.ids, encoded.mask, None))
    return batches

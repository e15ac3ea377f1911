"""Tokenizers by name: exact GPT-2 BPE (tiktoken) and byte-level BPE trained on the corpus.

Specs (``TOKENIZERS`` maps the part before ``:`` to a builder):

- ``gpt2``: the exact GPT-2 BPE (50257 tokens, ``<|endoftext|>`` = 50256) built
  as a ``tiktoken.Encoding`` from the verified offline files of fetch.py.
- ``bpe:N``: a byte-level BPE with at most N tokens trained with the
  ``tokenizers`` library on the training documents; ``<|endoftext|>`` is one of
  them (id 0). Small vocabularies suit tiny CPU models.

Every tokenizer encodes text literally: a ``<|endoftext|>`` inside a document is
encoded as ordinary text, never as the separator token. ``save(directory)``
writes ``tokenizer_meta.json`` plus the files needed to rebuild it offline
(``tokenizer.json`` for bpe, the two BPE files for gpt2), and
``load_tokenizer(directory)`` rebuilds it from them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from rdepth.data.fetch import GPT2_FILES, gpt2_bpe_files, verify_gpt2_files
from rdepth.errors import RdepthError
from rdepth.io import write_json, write_text

log = logging.getLogger(__name__)

EOT_TEXT = "<|endoftext|>"
META_FILE = "tokenizer_meta.json"
BPE_FILE = "tokenizer.json"
MIN_BPE_VOCAB = 257  # 256 byte tokens + <|endoftext|>
MAX_BPE_VOCAB = 1 << 20


class Tokenizer(Protocol):
    """What the rest of rdepth needs from a tokenizer. Token ids are ints in [0, vocab_size)."""

    name: str  # the spec it was built from, e.g. "gpt2" or "bpe:4096"
    vocab_size: int
    eot_id: int  # id of <|endoftext|>, the document separator

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """('gpt2', None) or ('bpe', N); RdepthError for an unknown name or a bad N."""
    kind, _, argument = spec.partition(":")
    if kind not in TOKENIZERS:
        raise RdepthError(f"unknown tokenizer {spec!r}: use gpt2 or bpe:N (e.g. bpe:4096)")
    if kind == "gpt2":
        if argument:
            raise RdepthError(f"tokenizer 'gpt2' takes no argument, got {spec!r}")
        return kind, None
    try:
        size = int(argument)
    except ValueError:
        raise RdepthError(f"tokenizer {spec!r}: N in bpe:N must be an integer") from None
    if not MIN_BPE_VOCAB <= size <= MAX_BPE_VOCAB:
        raise RdepthError(f"tokenizer {spec!r}: N must be in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}]")
    return kind, size


# ---------------------------------------------------------------- GPT-2 (tiktoken)


class Gpt2Tokenizer:
    """Exact GPT-2 BPE: "Hello world" -> [15496, 995]."""

    name = "gpt2"

    def __init__(self, bpe_files: dict[str, Path]):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        verify_gpt2_files(bpe_files)
        self._bpe_files = bpe_files
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(bpe_files["vocab.bpe"]),
            encoder_json_file=str(bpe_files["encoder.json"]),
            vocab_bpe_hash=GPT2_FILES["vocab.bpe"][1],
            encoder_json_hash=GPT2_FILES["encoder.json"][1],
        )
        self._encoding = tiktoken.Encoding(
            name="gpt2",
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: 50256},
            explicit_n_vocab=50257,
        )
        self.vocab_size = self._encoding.n_vocab
        self.eot_id = self._encoding.eot_token

    @property
    def fingerprint(self) -> str:
        """SHA-256 of what the ids mean: the two BPE files (themselves SHA-256 checked)."""
        return hashlib.sha256("gpt2:{}:{}".format(GPT2_FILES["encoder.json"][1],
                                                  GPT2_FILES["vocab.bpe"][1]).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, path in self._bpe_files.items():  # so the folder rebuilds it without a registry
            if path.resolve() != (directory / name).resolve():
                shutil.copyfile(path, directory / name)
        write_json(directory / META_FILE, {"spec": self.name})


def _build_gpt2(spec: str, documents: Callable[[], Iterable[str]] | None, cache_dir) -> Gpt2Tokenizer:
    return Gpt2Tokenizer(gpt2_bpe_files(cache_dir))


def _load_gpt2(directory: Path, spec: str) -> Gpt2Tokenizer:
    local = {name: directory / name for name in GPT2_FILES}
    if all(path.is_file() for path in local.values()):
        return Gpt2Tokenizer(local)
    return Gpt2Tokenizer(gpt2_bpe_files())


# ---------------------------------------------------------------- trained byte-level BPE


class BpeTokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation regex) from the ``tokenizers`` library."""

    def __init__(self, tokenizer, name: str):
        tokenizer.encode_special_tokens = True  # "<|endoftext|>" in text is plain text
        self._tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eot = tokenizer.token_to_id(EOT_TEXT)
        if eot is None:
            raise RdepthError(f"BPE tokenizer {name!r} has no {EOT_TEXT} token")
        self.eot_id = eot

    @property
    def fingerprint(self) -> str:
        """SHA-256 of what the ids mean: the token of every id, then the merges. Two BPEs with
        the same name and size trained on different text get different fingerprints."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        model = json.loads(self._tokenizer.to_str()).get("model", {})
        table = {"tokens": sorted((i, t) for t, i in vocab.items()), "merges": model.get("merges", [])}
        return hashlib.sha256(json.dumps(table, ensure_ascii=True).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / META_FILE, {"spec": self.name})
        write_text(directory / BPE_FILE, self._tokenizer.to_str())


def train_bpe(documents: Iterable[str], vocab_size: int, name: str | None = None) -> BpeTokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` tokens (incl. <|endoftext|>) on ``documents``.

    Fewer tokens result when the text has too few distinct pairs to merge.
    """
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    result = BpeTokenizer(tokenizer, name or f"bpe:{vocab_size}")
    if result.vocab_size < vocab_size:
        log.warning("BPE reached only %d of %d tokens: the corpus is too small", result.vocab_size, vocab_size)
    return result


def _build_bpe(spec: str, documents: Callable[[], Iterable[str]] | None, cache_dir) -> BpeTokenizer:
    _, size = parse_tokenizer_spec(spec)
    if documents is None:
        raise RdepthError(f"tokenizer {spec!r} must be trained: give it the training documents")
    return train_bpe(documents(), size, name=spec)


def _load_bpe(directory: Path, spec: str) -> BpeTokenizer:
    from tokenizers import Tokenizer as HfTokenizer

    path = directory / BPE_FILE
    if not path.is_file():
        raise RdepthError(f"missing tokenizer file {path}")
    try:
        tokenizer = HfTokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on a corrupt file
        raise RdepthError(f"cannot read tokenizer file {path}: {exc}") from None
    return BpeTokenizer(tokenizer, spec)


# name -> (build(spec, documents_factory, cache_dir), load(directory, spec))
TOKENIZERS: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_build_gpt2, _load_gpt2),
    "bpe": (_build_bpe, _load_bpe),
}


def build_tokenizer(
    spec: str,
    documents: Callable[[], Iterable[str]] | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Tokenizer:
    """The tokenizer for ``spec``; trained ones iterate ``documents()`` (a zero-arg callable)."""
    kind, _ = parse_tokenizer_spec(spec)
    build, _ = TOKENIZERS[kind]
    return build(spec, documents, cache_dir)


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Rebuild the tokenizer that ``save(directory)`` wrote."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise RdepthError(f"missing tokenizer file {meta_path}")
    try:
        spec = json.loads(meta_path.read_text())["spec"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RdepthError(f"corrupt tokenizer file {meta_path}") from None
    if isinstance(spec, str) and spec.startswith("task:"):  # a task vocabulary (rdepth.tasks)
        from rdepth.data.task_vocab import load_task_vocab

        return load_task_vocab(directory)
    kind, _ = parse_tokenizer_spec(spec)
    _, load = TOKENIZERS[kind]
    return load(directory, spec)


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what a tokenizer's ids mean (its ``fingerprint``; for any other tokenizer,
    the text of every id in order). Recorded in prepared data and in runs, and compared
    wherever a model meets data, so a same-named tokenizer with other tokens is caught."""
    own = getattr(tokenizer, "fingerprint", None)
    if isinstance(own, str):
        return own
    digest = hashlib.sha256()
    for index in range(int(tokenizer.vocab_size)):
        digest.update(repr(tokenizer.decode([index])).encode() + b"\n")
    return digest.hexdigest()


def saved_tokenizer_fingerprint(directory: str | os.PathLike) -> str | None:
    """:func:`tokenizer_fingerprint` of the tokenizer saved in ``directory`` (a prepared folder
    or ``RUN/tokenizer``); None when none is saved or no loader knows it (e.g. a task vocabulary)."""
    if not (Path(directory) / META_FILE).is_file():
        return None
    try:
        return tokenizer_fingerprint(load_tokenizer(directory))
    except RdepthError:
        return None

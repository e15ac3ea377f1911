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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from rdepth.errors import RdepthError
from rdepth.io import exclusive, read_json_object, write_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
TOKENIZER_META = "tokenizer_meta.json"
MIN_SPLIT_TOKENS = 1024  # fewer tokens than this in a split gets a warning


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

    def __enter__(self) -> ShardWriter:
        # One writer per prepared folder: the lock lives beside it (the folder itself is replaced
        # by a rename); holding it, the debris of killed prepares can be removed safely.
        self._lock = exclusive(self.out, "prepare", beside=True)
        self._lock.__enter__()
        try:
            clean_staging(self.out)
            self.directory = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent))
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.directory is not None and self.directory.exists():
                shutil.rmtree(self.directory, ignore_errors=True)
        finally:
            self._lock.__exit__(None, None, None)

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
        for split in SPLITS:
            if self.stats[split].tokens < MIN_SPLIT_TOKENS:
                log.warning("split %r has only %d tokens: too few to train or validate on "
                            "(use a larger corpus or another --val-fraction)", split, self.stats[split].tokens)
        if "tokenizer_sha256" not in manifest and (self.directory / TOKENIZER_META).is_file():
            fingerprint = _folder_tokenizer_fingerprint(self.directory)
            if fingerprint is not None:
                manifest = {**manifest, "tokenizer_sha256": fingerprint}
        full = {"format_version": FORMAT_VERSION, **manifest, "dtype": self.dtype.name,
                "eot_id": self.eot_id,
                "splits": {split: self.stats[split].as_dict(split) for split in SPLITS}}
        write_json(self.directory / MANIFEST, full, strict=True)  # read back as input: finite numbers only
        umask = _current_umask()  # temp files/folders are private (0600/0700): use normal modes
        for path in self.directory.iterdir():  # flush every file before the rename
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            path.chmod(0o666 & ~umask)
        self.directory.chmod(0o777 & ~umask)
        old = None
        if self.out.exists():
            # The old folder goes to a fixed hidden name first, so a crash between the two
            # renames leaves it where recover_replaced() (run by the next open or prepare) finds it.
            old = previous_folder(self.out)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.out, old)
            log.info("replacing the prepared data in %s", self.out)
        os.replace(self.directory, self.out)
        self.directory = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def previous_folder(out: Path) -> Path:
    """Where :meth:`ShardWriter.commit` parks the folder it replaces for a moment."""
    return out.parent / f".{out.name}.previous"


def recover_replaced(out: str | os.PathLike) -> None:
    """After a crash between commit's two renames ``out`` is missing and its old contents
    lie in ``.NAME.previous``: put them back. Staging debris (``.NAME.*.tmp``) of a killed
    prepare is removed when no prepare is writing (the caller holds the folder's lock)."""
    out = Path(out)
    previous = previous_folder(out)
    if not out.exists() and (previous / MANIFEST).is_file():
        os.replace(previous, out)
        log.warning("restored %s from an interrupted replacement", out)


def clean_staging(out: str | os.PathLike) -> None:
    """Remove what killed prepares of ``out`` left beside it (call while holding its lock)."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    recover_replaced(out)
    for path in out.parent.glob(f".{out.name}.*"):
        if path.is_dir() and (path.name.endswith(".tmp") or path.name.endswith(".old")
                              or path == previous_folder(out)):
            shutil.rmtree(path, ignore_errors=True)


def _folder_tokenizer_fingerprint(directory: Path) -> str | None:
    from rdepth.data.tokenizers import saved_tokenizer_fingerprint

    return saved_tokenizer_fingerprint(directory)


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _read_manifest(directory: Path) -> dict:
    """The manifest, every field the readers use checked for type and consistency
    (a hand-edited dtype, a shard file outside the folder, a string token count are one-line errors)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise RdepthError(f"missing {path}: run `rdepth prepare` first")
    manifest = read_json_object(path, "manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise RdepthError(f"{path}: unsupported format_version (expected {FORMAT_VERSION})")
    for key in ("dtype", "vocab_size", "eot_id", "splits"):
        if key not in manifest:
            raise RdepthError(f"{path}: missing field {key!r}")
    vocab_size, eot_id = manifest["vocab_size"], manifest["eot_id"]
    if not _is_count(vocab_size) or vocab_size < 2 or vocab_size > 1 << 32:
        raise RdepthError(f"{path}: vocab_size must be an integer in [2, 2^32], got {vocab_size!r}")
    if not _is_count(eot_id) or eot_id >= vocab_size:
        raise RdepthError(f"{path}: eot_id must be an integer in [0, vocab_size), got {eot_id!r}")
    if manifest["dtype"] != token_dtype(vocab_size).name:
        raise RdepthError(f"{path}: dtype {manifest['dtype']!r} is not the {token_dtype(vocab_size).name} "
                          f"that a vocabulary of {vocab_size} is written in: corrupt")
    if "tokenizer" in manifest and not isinstance(manifest["tokenizer"], str):
        raise RdepthError(f"{path}: tokenizer must be a string, got {manifest['tokenizer']!r}")
    fingerprint = manifest.get("tokenizer_sha256")
    if fingerprint is not None and not _is_sha256(fingerprint):
        raise RdepthError(f"{path}: tokenizer_sha256 must be a SHA-256 hex string")
    _check_splits(path, manifest["splits"])
    return manifest


def _check_splits(path: Path, splits) -> None:
    """Each split of the manifest: an object naming its own shard file, a token count and a SHA-256."""
    if not isinstance(splits, dict):
        raise RdepthError(f"{path}: splits must be an object")
    for split in SPLITS:
        info = splits.get(split)
        if info is None:
            raise RdepthError(f"{path}: no split {split!r}")
        if not isinstance(info, dict):
            raise RdepthError(f"{path}: split {split!r} must be an object")
        if info.get("file") != shard_file(split):
            raise RdepthError(f"{path}: split {split!r} must be stored in {shard_file(split)}, "
                              f"got {info.get('file')!r}")
        if not _is_count(info.get("tokens")):
            raise RdepthError(f"{path}: split {split!r} tokens must be an integer >= 0, got {info.get('tokens')!r}")
        if not _is_sha256(info.get("sha256")):
            raise RdepthError(f"{path}: split {split!r} sha256 must be a SHA-256 hex string")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


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
    def open(cls, directory: str | os.PathLike, verify: bool | tuple[str, ...] = False) -> TokenShards:
        """Open and check a prepared folder; ``verify`` also re-hashes each shard (True) or the
        named splits (``("val",)``: what evaluation reads, a small share of the data).

        RdepthError (naming the file) for a missing folder or manifest, a manifest
        field of the wrong type, a shard whose size disagrees with the manifest's token
        count, an empty split or (with ``verify``) a hash mismatch.
        """
        directory = Path(directory)
        recover_replaced(directory)
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
            if (verify is True or (verify and split in verify)) and file_sha256(path) != info["sha256"]:
                raise RdepthError(f"shard {path} fails its SHA-256 check: corrupt")
            arrays[split] = np.memmap(path, dtype=dtype, mode="r")
        return cls(directory, manifest, arrays["train"], arrays["val"])

    def check_token_ids(self, splits: tuple[str, ...] = SPLITS, chunk: int = 1 << 24) -> None:
        """A one-line error if any id of ``splits`` is outside ``[0, vocab_size)``
        (one pass over the memmaps, in chunks)."""
        vocab_size = int(self.manifest["vocab_size"])
        for name in splits:
            tokens = self.split(name)
            for start in range(0, len(tokens), chunk):
                largest = int(np.max(tokens[start:start + chunk]))
                if largest >= vocab_size:
                    raise RdepthError(f"shard {self.directory / shard_file(name)} holds token id {largest}, "
                                      f"outside the vocabulary of {vocab_size}: corrupt")

    @cached_property
    def tokenizer_fingerprint(self) -> str | None:
        """SHA-256 of what the ids mean (see ``rdepth.data.tokenizers.tokenizer_fingerprint``):
        the manifest's, else computed from the folder's tokenizer; None if neither exists."""
        recorded = self.manifest.get("tokenizer_sha256")
        if recorded is not None:
            return recorded
        if not (self.directory / TOKENIZER_META).is_file():
            return None
        return _folder_tokenizer_fingerprint(self.directory)

    def verify_tokenizer(self) -> None:
        """A one-line error if the folder's tokenizer files no longer match the manifest's fingerprint."""
        recorded = self.manifest.get("tokenizer_sha256")
        if recorded is None or not (self.directory / TOKENIZER_META).is_file():
            return
        actual = _folder_tokenizer_fingerprint(self.directory)
        if actual is not None and actual != recorded:
            raise RdepthError(f"the tokenizer files in {self.directory} do not match its manifest "
                              "(tokenizer_sha256): they were replaced after the data was prepared")

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

    def problem_index(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The split's problem index (``<split>_problems.npy``, int64 ``[P, 2]``: each problem's
        start offset in the split and its difficulty), or None for data without one (text).
        Task data writes it so that training windows can start at a problem and follow a
        difficulty curriculum. Offsets out of range or out of order are an error."""
        path = self.directory / f"{name}_problems.npy"
        if not path.is_file():
            return None
        try:
            index = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise RdepthError(f"problem index {path} is unreadable: {error}") from None
        tokens = len(self.split(name))
        if index.ndim != 2 or index.shape[1] != 2 or index.shape[0] < 1 or not np.issubdtype(index.dtype, np.integer):
            raise RdepthError(f"problem index {path} must be an integer array [problems, 2], got {index.shape}: corrupt")
        starts = index[:, 0].astype(np.int64)
        if starts[0] < 0 or starts[-1] >= tokens or np.any(np.diff(starts) <= 0):
            raise RdepthError(f"problem index {path} does not fit the {tokens}-token split: corrupt")
        return starts, index[:, 1].astype(np.int64)

    def split(self, name: str) -> np.memmap:
        if name not in SPLITS:
            raise RdepthError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        return getattr(self, name)

    @cached_property
    def tokenizer(self):
        """The folder's tokenizer (built on first use; training needs only the shards)."""
        from rdepth.data.tokenizers import load_tokenizer

        return load_tokenizer(self.directory)

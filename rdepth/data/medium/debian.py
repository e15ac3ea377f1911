"""Fetch Debian packages with ``apt-get download`` and read their files without installing them.

A ``.deb`` is kept in the download cache under its own file name
(``PACKAGE_VERSION_ARCH.deb``, with ``:`` in the version written ``%3a`` as apt
does), so a rerun reuses it. Its files are read from the tar stream that
``dpkg-deb --fsys-tarfile`` prints, whatever compression the package uses, and
never written to disk.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from rdepth.errors import RdepthError

log = logging.getLogger(__name__)


def _deb_name(package: str, version: str) -> str:
    """The start of apt's file name for ``package`` at ``version`` (the architecture follows)."""
    return f"{package}_{version.replace(':', '%3a')}_"


def _cached_deb(cache: Path, package: str, version: str) -> Path | None:
    if not cache.is_dir():
        return None
    prefix = _deb_name(package, version)
    found = sorted(p for p in cache.iterdir() if p.name.startswith(prefix) and p.name.endswith(".deb"))
    return found[0] if found else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def candidate_version(package: str) -> str | None:
    """The version apt would download now (``apt-cache policy``), or None if apt knows none."""
    try:
        result = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True)
    except OSError:
        return None
    for line in result.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Candidate" and value.strip() not in ("", "(none)"):
            return value.strip()
    return None


def fetch_deb(package: str, version: str, cache: Path) -> Path:
    """Path of ``package``'s ``.deb`` at ``version``, downloaded into ``cache`` unless already there.

    When the mirror no longer serves ``version`` (Debian replaces a package on a
    point or security release), the version apt offers now is fetched instead,
    with a warning; the caller records the version of the file it got
    (:func:`deb_version`). Raises RdepthError naming the package when apt fails.
    """
    cached = _cached_deb(cache, package, version)
    if cached is not None:
        return cached
    if shutil.which("apt-get") is None:
        raise RdepthError(f"cannot download Debian package {package}: apt-get is not installed")
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".apt-", dir=cache))
    try:
        wanted = f"{package}={version}"
        result = subprocess.run(["apt-get", "download", wanted], cwd=staging, capture_output=True, text=True)
        if result.returncode != 0:
            current = candidate_version(package)
            if current is None or current == version:
                raise RdepthError(f"apt-get download {wanted} failed: {_last_line(result.stderr)} "
                                  "(run apt-get update first)")
            cached = _cached_deb(cache, package, current)
            if cached is not None:
                log.warning("%s %s is gone from the mirror; using the cached %s", package, version, current)
                return cached
            log.warning("%s %s is gone from the mirror; downloading %s", package, version, current)
            result = subprocess.run(["apt-get", "download", f"{package}={current}"], cwd=staging,
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RdepthError(f"apt-get download {package}={current} failed: {_last_line(result.stderr)}")
        debs = sorted(staging.glob("*.deb"))
        if len(debs) != 1:
            raise RdepthError(f"apt-get download {wanted} produced {len(debs)} .deb files")
        target = cache / debs[0].name
        os.replace(debs[0], target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def deb_version(deb: Path) -> str:
    """The ``Version`` field of a ``.deb`` (read with ``dpkg-deb -f``)."""
    try:
        result = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True)
    except OSError as exc:
        raise RdepthError(f"cannot run dpkg-deb on {deb.name}: {exc}") from None
    if result.returncode != 0 or not result.stdout.strip():
        raise RdepthError(f"cannot read {deb}: {_last_line(result.stderr)} (delete it to download again)")
    return result.stdout.strip()


def deb_files(deb: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file of ``deb`` whose path (``/usr/...``) ``wanted`` accepts,
    in the package's own order. Raises RdepthError for an unreadable package."""
    try:
        process = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise RdepthError(f"cannot run dpkg-deb on {deb.name}: {exc}") from None
    finished = False
    try:
        with tarfile.open(fileobj=process.stdout, mode="r|") as tar:
            for member in tar:
                path = "/" + member.name.lstrip("./")
                if member.isfile() and wanted(path):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        yield path, handle.read()
        finished = True
    except tarfile.TarError as exc:
        raise RdepthError(f"cannot read {deb}: {exc} (delete it to download again)") from None
    finally:
        process.stdout.close()
        if not finished:  # stopped early or failed: dpkg-deb may still be writing
            process.kill()
        stderr = process.stderr.read().decode(errors="replace")
        process.stderr.close()
        code = process.wait()
    if code != 0:
        raise RdepthError(f"cannot read {deb}: {_last_line(stderr)} (delete it to download again)")

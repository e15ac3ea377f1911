"""New output folders, written whole or not at all.

``rdepth export``, ``import-hf`` and ``retrofit`` refuse an ``--out`` that exists and
is not empty (nothing is overwritten), write into a hidden staging folder beside it
(``.OUT.<8 hex>.staging``), and rename it into place only when everything is written.

While it writes, the command holds ``--out``'s lock (:func:`rdepth.io.exclusive`, beside
it), which the kernel drops however the process ends. So a staging folder of ``OUT``
found while holding that lock belongs to a writer that was killed (SIGKILL, power loss)
before it could clean up: the next command writing ``OUT`` removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.io import exclusive

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".staging"


def check_new_folder(out: str | os.PathLike) -> Path:
    """``out`` as a path; a one-line error if it exists and is a file or a non-empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RdepthError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    return out


def _staging_pattern(out: Path) -> re.Pattern:
    """The names of ``out``'s staging folders, and only theirs (``.run.x.<hex>.staging`` is ``run.x``'s)."""
    return re.compile(re.escape(f".{out.name}.") + r"[0-9a-f]{8}" + re.escape(STAGING_SUFFIX))


def stale_staging(out: Path) -> list[Path]:
    """``out``'s staging folders beside it that this user owns (real folders, not links). Call while
    holding ``out``'s lock: each is then a killed writer's."""
    pattern = _staging_pattern(out)
    found = []
    with contextlib.suppress(FileNotFoundError):
        for path in out.parent.iterdir():
            if not pattern.fullmatch(path.name):
                continue
            with contextlib.suppress(OSError):
                info = path.lstat()
                if path.is_dir() and not path.is_symlink() and info.st_uid == os.getuid():
                    found.append(path)
    return sorted(found)


def _new_staging(out: Path) -> Path:
    for _ in range(100):
        staging = out.parent / f".{out.name}.{secrets.token_hex(4)}{STAGING_SUFFIX}"
        try:
            staging.mkdir(mode=0o755)
        except FileExistsError:
            continue
        os.chmod(staging, 0o755)  # whatever the umask: the folder becomes ``out``
        return staging
    raise RdepthError(f"cannot create a staging folder beside {out}")


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, command: str) -> Iterator[Path]:
    """Yield an empty staging folder; on success it becomes ``out`` (checked new and empty). ``command``
    (``import-hf``, ...) names the holder of ``out``'s lock to a second writer of it, which is refused."""
    out = check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out, command, beside=True):
        for debris in stale_staging(out):
            shutil.rmtree(debris, ignore_errors=True)
            log.info("removed %s, a staging folder left by a killed writer of %s", debris, out)
        staging = _new_staging(out)
        try:
            yield staging
            check_new_folder(out)  # still free after the work
            if out.exists():
                out.rmdir()
            os.replace(staging, out)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

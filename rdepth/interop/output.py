"""New output folders, written whole or not at all.

``rdepth export``, ``import-hf`` and ``retrofit`` refuse an ``--out`` that exists and
is not empty (nothing is overwritten), write into a hidden staging folder beside it,
and rename it into place only when everything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rdepth.errors import RdepthError


def check_new_folder(out: str | os.PathLike) -> Path:
    """``out`` as a path; a one-line error if it exists and is a file or a non-empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RdepthError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    return out


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder; on success it becomes ``out`` (checked new and empty)."""
    out = check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(staging, 0o755)
    try:
        yield staging
        check_new_folder(out)  # still free after the work
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

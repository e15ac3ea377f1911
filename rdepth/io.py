"""Small file helpers shared by every writer: atomic writes and run metadata.

Every file rdepth writes goes through a temporary file in the same folder and
``os.replace``, so a crash or kill mid-write never leaves a half-written file
where a good one stood.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success move it into place.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as handle:  # flush to disk before the rename
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line (metrics logs); a partial last line is tolerated by readers."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record, default=_json_default) + "\n")


def read_json_object(path: str | os.PathLike, what: str = "") -> dict:
    """A JSON file that must hold an object; a missing, malformed or non-object file is a one-line error."""
    from rdepth.errors import RdepthError

    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if not path.is_file():
        raise RdepthError(f"{what or 'file'} not found: there is no {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RdepthError(f"{label} is not valid JSON ({getattr(exc, 'msg', type(exc).__name__)})") from None
    if not isinstance(data, dict):
        raise RdepthError(f"{label} is not a JSON object")
    return data


def dataclass_from_dict(cls: type, data: dict[str, Any], what: str) -> Any:
    """``cls(**data)``, refusing fields the dataclass does not have (one-line error naming them)."""
    import dataclasses

    from rdepth.errors import RdepthError

    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise RdepthError(f"{what}: unknown field(s) {', '.join(unknown)}")
    return cls(**data)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    records = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
    return records


def environment_info() -> dict:
    """Versions, device and code revision recorded beside every run and number."""
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        if rev.returncode == 0:
            info["git"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info

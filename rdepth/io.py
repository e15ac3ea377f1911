"""Small file helpers shared by every writer: atomic writes, one writer per folder, run metadata.

Every file rdepth writes goes through a temporary file in the same folder and
``os.replace``, so a crash or kill mid-write never leaves a half-written file
where a good one stood.

One writer per output folder: every command that writes a folder (train,
prepare, analyze, sweep, surrogate, demo) wraps its work in :func:`exclusive`::

    with exclusive(config.out, "train"):
        ...  # nobody else writes config.out meanwhile

The lock is ``fcntl.flock`` on ``FOLDER/.rdepth.lock`` (or, with ``beside=True``,
on ``PARENT/.FOLDER.rdepth.lock`` for writers that replace the folder whole by a
rename, such as prepare). The kernel drops it when the process exits, however it
exits (SIGKILL included), so a crash never leaves a stale lock. A second writer
gets a one-line :class:`RdepthError` naming the holder, at once (never a wait).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, overwrite: bool = True, parents: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (``.NAME.XXXXXXXX.tmp``, which :func:`recover_folder` removes
    when a kill leaves it); on success move it into place.

    On an exception the temporary file is removed and ``path`` is untouched. ``parents=False``: the
    folder must exist already (a folder removed meanwhile is a FileNotFoundError, never re-created). With
    ``overwrite=False`` the file is put in place by a hard link, which the kernel refuses when
    ``path`` exists: of two writers racing for one name exactly one wins, and the other gets a
    one-line RdepthError (a check-then-write would let both "succeed" and the second replace the first).
    """
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as handle:  # flush to disk before the rename
            os.fsync(handle.fileno())
        os.chmod(tmp_path, 0o666 & ~current_umask())  # mkstemp's 0600 would hide reports from others
        if overwrite:
            os.replace(tmp_path, path)
        else:
            try:
                os.link(tmp_path, path)
            except FileExistsError:
                raise RdepthError(f"{path} exists; pass another output (nothing is overwritten)") from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def current_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def ordinary_mode(path: str | os.PathLike) -> None:
    """Give a file written by a library that creates it private (safetensors: 0600) the mode of every
    other file rdepth writes (0666 less the umask: 0644 usually)."""
    os.chmod(path, 0o666 & ~current_umask())


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool = True) -> None:
    with atomic_path(path, overwrite=overwrite) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any, *, overwrite: bool = True, strict: bool = False,
               non_finite: Callable[[float], Any] | None = None) -> None:
    """``obj`` as indented standard JSON, atomically. Python would write a NaN or an infinity as the
    non-standard tokens ``NaN``/``Infinity``, which other tools' parsers refuse; so none is ever written:
    ``strict`` makes one an error (files other commands read back as input: exit profiles, configs,
    manifests), otherwise it becomes ``null`` (a result that is not a number: summaries, sweeps,
    analyses), or ``non_finite(value)`` where given (e.g. the text a report page shows for it)."""
    text = json_text(obj, path, strict=strict, non_finite=non_finite, indent=2)
    write_text(path, text + "\n", overwrite=overwrite)


def json_text(obj: Any, where: Any = "JSON", *, strict: bool = False,
              non_finite: Callable[[float], Any] | None = None, indent: int | None = None) -> str:
    """``obj`` as standard JSON text (see :func:`write_json` for ``strict`` and ``non_finite``); numpy and
    torch values become lists and numbers, paths text."""
    def plain(value: Any, key: str) -> Any:
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            if strict:
                raise RdepthError(f"cannot write {where}: {key or 'the value'} is not finite ({value})")
            return None if non_finite is None else non_finite(value)
        if isinstance(value, dict):
            return {k: plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, (str, int, bool)) or value is None:
            return value
        return plain(_json_default(value), key)

    return json.dumps(plain(obj, ""), indent=indent, allow_nan=False)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line (metrics logs) in a single write.

    A line cut by a crash is closed first, so it never swallows this record.
    """
    line = json_text(record, path) + "\n"  # standard JSON: a non-finite number is null
    with open(path, "ab+") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                line = "\n" + line
        handle.write(line.encode())


def truncate_jsonl(path: str | os.PathLike, keep) -> int:
    """Rewrite ``path`` (atomically) with only its whole, parseable lines whose record
    ``keep(record)`` accepts; returns how many records were dropped. A missing file is left alone."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            dropped += 1
            continue
        if isinstance(record, dict) and keep(record):
            kept.append(line.decode() + "\n")
        else:
            dropped += 1
    if dropped:
        write_text(path, "".join(kept))
    return dropped


def read_json_object(path: str | os.PathLike, what: str = "") -> dict:
    """A JSON file that must hold an object; a missing, malformed or non-object file is a one-line error."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if not path.is_file():
        raise RdepthError(f"{what or 'file'} not found: there is no {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise RdepthError(f"{label} is not valid JSON ({getattr(exc, 'msg', type(exc).__name__)})") from None
    if not isinstance(data, dict):
        raise RdepthError(f"{label} is not a JSON object")
    return data


def read_json_if_present(path: str | os.PathLike) -> dict | None:
    """A saved JSON file, or None when there is none; a corrupt file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RdepthError(f"corrupt {path}: {exc}") from None


class StageTimer:
    """Runs a pipeline's named stages, logging each as it starts and keeping its wall time in
    ``seconds`` (name -> seconds, one decimal)."""

    def __init__(self, log) -> None:
        self.log = log
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn, *args):
        begin = time.perf_counter()
        self.log.info("== %s", name)
        value = fn(*args)
        self.seconds[name] = round(time.perf_counter() - begin, 1)
        return value

    @property
    def wall(self) -> float:
        return round(time.perf_counter() - self.started, 1)


def dataclass_from_dict(cls: type, data: dict[str, Any], what: str) -> Any:
    """``cls(**data)`` from a saved file: unknown fields and values of the wrong type
    (a string where a number belongs, a float for an integer) are one-line errors naming them."""
    import dataclasses
    import typing

    if not isinstance(data, dict):
        raise RdepthError(f"{what}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise RdepthError(f"{what}: unknown field(s) {', '.join(map(str, unknown))}")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if not value_matches(value, hints.get(name, Any)):
            raise RdepthError(f"{what}: field {name} has the wrong type ({value!r})")
    try:
        return cls(**data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RdepthError(f"{what}: {exc}") from None


# A JSON value against a plain field type: bool is no int or float; a Path is stored as text.
_SCALAR_CHECKS = {
    type(None): lambda value: value is None,
    bool: lambda value: isinstance(value, bool),
    int: lambda value: isinstance(value, int) and not isinstance(value, bool),
    float: lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    str: lambda value: isinstance(value, str),
    Path: lambda value: isinstance(value, str),
}


def value_matches(value: Any, annotation: Any) -> bool:
    """Whether a JSON-loaded ``value`` fits a field annotation (int, float, str, bool, Path,
    ``X | None``, ``tuple[X, ...]``, ``list[X]``, ``dict[str, X]``); unknown annotations pass."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        return any(value_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[annotation](value)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(value_matches(v, args[0] if args else Any) for v in value)
    if origin is dict:
        _, value_type = typing.get_args(annotation) or (Any, Any)
        return isinstance(value, dict) and all(isinstance(k, str) and value_matches(v, value_type)
                                               for k, v in value.items())
    return True


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


# ---------------------------------------------------------------- one writer per folder

LOCK_NAME = ".rdepth.lock"


def lock_path(folder: str | os.PathLike, beside: bool = False) -> Path:
    """Where the lock of ``folder`` lives (inside it, or beside it with ``beside``)."""
    folder = Path(folder)
    if beside:
        return folder.parent / f".{folder.name}{LOCK_NAME}"
    return folder / LOCK_NAME


def _holder(path: Path) -> str:
    """'rdepth train (pid 123)' from the lock file, or '' if unreadable."""
    try:
        info = json.loads(path.read_text() or "{}")
        return f"rdepth {info['command']} (pid {int(info['pid'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextlib.contextmanager
def exclusive(folder: str | os.PathLike, command: str, *, beside: bool = False) -> Iterator[Path]:
    """Hold the exclusive write lock of ``folder`` for the block; yields the folder.

    Creates ``folder`` (with ``beside``: its parent) when missing; a folder this call
    created is removed again on exit if nothing was written into it. The lock file is
    removed on exit.
    RdepthError (one line) when ``folder`` is a file, cannot be created, or is held
    by another process.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RdepthError(f"output {folder} exists and is not a folder")
    home = folder.parent if beside else folder
    created = not home.exists()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RdepthError(f"cannot create output folder {home}: {exc.strerror or exc}") from None
    path = lock_path(folder, beside)
    key = os.path.realpath(path)
    if key in _HELD:  # this process holds it already (a pipeline inside a command): re-entrant
        _HELD[key] += 1
        try:
            yield folder
        finally:
            _HELD[key] -= 1
        return
    handle = _acquire(path, folder, command)
    _HELD[key] = 1
    try:
        if not beside:
            recover_folder(folder)  # what a killed writer left: finish its swap, drop its temporary files
        yield folder
    finally:
        del _HELD[key]
        # Unlinked while still held, then released: a process that opened the old file meanwhile
        # finds it is no longer the one at ``path`` (see _acquire) and starts over.
        try:
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
                path.unlink()
        except OSError:
            pass
        if created and not beside:
            with contextlib.suppress(OSError):
                folder.rmdir()  # created by this call and left empty
        handle.close()  # releases the lock


_HELD: dict[str, int] = {}  # lock files this process holds -> nesting depth


class LockHeld(RdepthError):
    """:func:`exclusive` found the folder locked by another process; ``holder`` names it
    ("rdepth train (pid 123)", or "" when the lock file does not say)."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder


def _acquire(path: Path, folder: Path, command: str):
    """Open and flock ``path``; retry if the file was replaced between open and lock."""
    for _ in range(20):
        try:
            handle = open(path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the handle)
        except OSError as exc:
            raise RdepthError(f"cannot write the lock file {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                holder = _holder(path)
                raise LockHeld(
                    f"{folder} is in use by {holder or 'another rdepth process'}; wait for it to finish "
                    "or choose another output folder", holder
                ) from None
            raise RdepthError(f"cannot lock {path}: {exc.strerror or exc}") from None
        try:  # the file we locked must still be the one at ``path`` (not unlinked meanwhile)
            same = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            handle.close()
            time.sleep(0.01)
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"command": command, "pid": os.getpid(), "since": time.time()}) + "\n")
        handle.flush()
        return handle
    raise RdepthError(f"cannot lock {path}: it keeps being replaced")


# ---------------------------------------------------------------- whole replacement of a re-run's files

STAGING_NAME = ".rdepth-staging"  # a re-run's new files, written here first
JOURNAL_NAME = ".rdepth-swap.json"  # written once the staging folder is complete: the commit point


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, *, seed: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a staging folder in which a command writes its whole result for ``out``; on success every
    file written there replaces its namesake in ``out`` (:func:`commit_staged`).

    A kill before the commit point leaves ``out`` as it was (the staging folder is removed by the next
    command that locks ``out``); a kill after it is finished by that command (:func:`recover_folder`),
    so readers see the old result or the new one, never a mix. ``seed``: folders of ``out`` copied into
    the staging folder first, because the writer reads and extends them (a report page's saved
    sections). Call it while holding ``out``'s lock (:func:`exclusive`). On an exception the staging
    folder is removed and ``out`` is untouched.
    """
    import shutil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / STAGING_NAME
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name in seed:
            if (out / name).is_dir() and not (out / name).is_symlink():
                shutil.copytree(out / name, staging / name)
        yield staging
        commit_staged(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def commit_staged(out: Path) -> None:
    """Write the journal (the list of staged files; its atomic write is the commit point), then move
    each staged file over its namesake in ``out`` and drop the journal and the staging folder."""
    staging = out / STAGING_NAME
    files = sorted(str(path.relative_to(staging)) for path in staging.rglob("*") if path.is_file())
    write_json(out / JOURNAL_NAME, {"files": files})
    _roll_forward(out)


def _roll_forward(out: Path) -> None:
    import shutil

    journal = out / JOURNAL_NAME
    try:
        files = json.loads(journal.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = []  # a journal that is not whole was never committed (its write is atomic): nothing to do
    staging = out / STAGING_NAME
    for name in files:
        source, target = staging / name, out / name
        if ".." in Path(name).parts or not source.is_file():
            continue  # moved already before a kill
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
    shutil.rmtree(staging, ignore_errors=True)
    journal.unlink(missing_ok=True)


def output_folder_name(folder: str | os.PathLike) -> str:
    """The name of the folder a result is for: ``OUT``'s own name, also while it is being written in
    ``OUT/.rdepth-staging`` (page titles name the run, never the staging folder)."""
    folder = Path(folder).resolve()
    return folder.parent.name if folder.name == STAGING_NAME else folder.name


def final_path(path: str | os.PathLike) -> Path:
    """Where a file written in a staging folder will live once the staging is committed."""
    path = Path(path)
    parts = path.parts
    if STAGING_NAME in parts:
        index = parts.index(STAGING_NAME)
        return Path(*parts[:index], *parts[index + 1:])
    return path


# What a report re-run copies into its staging folder first: the page's saved sections and the
# figures other sections' blocks show (the page is re-rendered whole from them).
REPORT_SEED = ("report", "figures")


# mkstemp's names in atomic_path: ".NAME." + 8 random characters + ".tmp"
_TMP_PATTERN = __import__("re").compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
# The subfolders rdepth writes with atomic_path (never any other folder of the user's).
RDEPTH_SUBFOLDERS = ("checkpoints", "figures", "report", "report/sections", "geometry")


def is_leftover_tmp(path: Path) -> bool:
    """A temporary file of :func:`atomic_path` (``.NAME.XXXXXXXX.tmp``) that a kill left behind."""
    return bool(_TMP_PATTERN.match(path.name)) and path.is_file() and not path.is_symlink()


def recover_folder(folder: str | os.PathLike) -> list[str]:
    """Run by every command when it locks ``folder``: finish a committed swap (:func:`staged_output`),
    remove an uncommitted staging folder, and remove leftover temporary files of atomic writes in
    ``folder`` and the subfolders rdepth writes there (:data:`RDEPTH_SUBFOLDERS`). Returns what was
    removed or finished."""
    import shutil

    folder = Path(folder)
    done = []
    if (folder / JOURNAL_NAME).is_file():
        _roll_forward(folder)
        done.append(JOURNAL_NAME)
    if (folder / STAGING_NAME).exists():
        shutil.rmtree(folder / STAGING_NAME, ignore_errors=True)
        done.append(STAGING_NAME)
    if folder.is_dir():
        for parent in [folder, *(folder / name for name in RDEPTH_SUBFOLDERS)]:
            if not parent.is_dir() or parent.is_symlink():
                continue
            for path in parent.iterdir():
                if is_leftover_tmp(path):
                    path.unlink(missing_ok=True)
                    done.append(str(path.relative_to(folder)))
    return done

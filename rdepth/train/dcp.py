"""Checkpoints of sharded (FSDP) runs through ``torch.distributed.checkpoint`` (DCP).

Layout: the usual ``RUN/checkpoints/step_N/`` folder (config.json, state.json, ``latest``,
rotation) with the weights and AdamW state in ``dcp/`` instead of model.safetensors and
trainer.pt: every rank writes its own shards, rank 0 the metadata. The folder is written
under ``.step_N.dcp`` and renamed into place, so a kill mid-save leaves the earlier
checkpoints whole (the staging folder is debris that the next start removes).

DCP records each tensor's global shape and its pieces, so a run saved at one world size
resumes at another: the shards are re-cut on load.

:func:`consolidate` turns such a checkpoint into the usual one by adding model.safetensors
(one process, no process group): ``rdepth eval/generate/export`` then read it as any other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.io import LockHeld, atomic_path, exclusive, json_text, ordinary_mode, read_json_object, write_text
from rdepth.run import checkpoint as ckpt

log = logging.getLogger(__name__)

DCP_DIR = "dcp"


def is_dcp_checkpoint(checkpoint: Path) -> bool:
    return (Path(checkpoint) / DCP_DIR).is_dir()


def _failures():
    """What DCP raises: CheckpointException (a BaseException gathering every rank's failure) and
    the ordinary exceptions of a single process."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _reason(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # CheckpointException: {rank: (exception, traceback)}
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__} {' '.join(str(inner).split())[:160]}".strip()
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         model_config: ModelConfig, state: dict[str, Any], is_main: bool) -> Path | None:
    """Write ``RUN/checkpoints/step_N`` from every rank (a collective); returns its path on the
    main rank, None on the others."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(run_dir) / "checkpoints"
    final = root / ckpt.checkpoint_name(step)
    staging = root / f".{final.name}.dcp"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging / DCP_DIR)
    except _failures() as exc:  # DCP gathers every rank's failure into one exception, raised on all ranks
        raise RdepthError(f"cannot write checkpoint {final}: {_reason(exc)} (disk full or not writable?); "
                          "earlier checkpoints are intact") from None
    dist.barrier()
    if is_main:
        # standard JSON, as every checkpoint's: the config strictly finite, a non-finite state value null
        (staging / "config.json").write_text(json_text(model_config.to_dict(), final, strict=True, indent=2) + "\n")
        (staging / "state.json").write_text(json_text({"step": step, **state}, final, indent=2) + "\n")
        for path in [*staging.iterdir(), *(staging / DCP_DIR).iterdir()]:
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
                ordinary_mode(path)
        ckpt.publish_folder(staging, final)
        write_text(root / "latest", final.name + "\n")
    dist.barrier()
    return final if is_main else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """state.json of a DCP checkpoint, checked as :func:`rdepth.run.checkpoint.load_trainer_state` checks it."""
    if not is_dcp_checkpoint(checkpoint):
        raise RdepthError(f"checkpoint {checkpoint} is not a sharded (--parallel fsdp) checkpoint: it has no "
                          f"{DCP_DIR}/ folder; resume it without --parallel fsdp, or start a new run")
    path = checkpoint / "state.json"
    if not path.is_file():
        raise RdepthError(f"checkpoint {checkpoint} has no state.json to resume from")
    return ckpt.check_state(read_json_object(path, "checkpoint state"), path, checkpoint)


def load(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the sharded weights and AdamW state of ``checkpoint`` into the sharded ``model`` and
    ``optimizer`` (a collective), re-cut for this world size when it was saved at another."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = read_state(checkpoint).get("world_size")
    if isinstance(saved, int) and saved != dist.get_world_size() and dist.get_rank() == 0:
        log.info("resharding %s: saved by %d ranks, loaded by %d", checkpoint.name, saved, dist.get_world_size())
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=checkpoint / DCP_DIR)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except _failures() as exc:
        raise RdepthError(f"cannot load the distributed checkpoint {checkpoint / DCP_DIR} into this model at this "
                          f"world size ({_reason(exc)}): corrupt or from another model") from None


def _checkpoint_of(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise RdepthError(f"checkpoint {path} not found")
    checkpoint = path if is_dcp_checkpoint(path) else ckpt.resolve_checkpoint(path)
    if not is_dcp_checkpoint(checkpoint):
        raise RdepthError(f"{checkpoint} holds no distributed checkpoint ({DCP_DIR}/): nothing to consolidate")
    return checkpoint


@contextlib.contextmanager
def _quiet_dcp_logs() -> Iterator[None]:
    """DCP logs a failed read with tracebacks on the root logger before it raises; the exception becomes
    rdepth's one line, so those records go to this module's debug log (``-v``) instead."""
    def demote(record: logging.LogRecord) -> bool:
        if "torch/distributed/checkpoint/" not in record.pathname.replace(os.sep, "/"):
            return True
        log.debug("torch.distributed.checkpoint: %s", record.getMessage(), exc_info=record.exc_info)
        return False

    root = logging.getLogger()
    root.addFilter(demote)
    try:
        yield
    finally:
        root.removeFilter(demote)


@contextlib.contextmanager
def _run_lock(checkpoint: Path) -> Iterator[str]:
    """Hold the write lock of the run that ``checkpoint`` belongs to (the one ``rdepth train`` holds; a
    checkpoint outside a run: its own folder's) and remove what a killed consolidate left there. Yields
    "" then; while training holds the lock, yields its holder ("rdepth train (pid N)") instead: the run
    is read without the lock (see :func:`consolidate`)."""
    in_run = checkpoint.parent.name == "checkpoints"
    folder = checkpoint.parent.parent if in_run else checkpoint
    lock, holder = contextlib.ExitStack(), ""
    try:
        lock.enter_context(exclusive(folder, "consolidate"))
    except LockHeld as held:
        holder = held.holder or "another rdepth process"
    if holder:  # (outside the except: an error while reading beside training is not "during" LockHeld)
        log.warning("%s is in use by %s: reading %s beside it, without the lock (its --keep-last rotation may "
                    "remove that checkpoint later, model.safetensors included)", folder, holder, checkpoint.name)
        yield holder
        return
    with lock:
        if in_run:
            removed = ckpt.clean_debris(folder)
        else:  # (exclusive removed atomic_path's; this adds the fixed name of earlier versions)
            removed = [temp.name for temp in ckpt.weight_temp_files(checkpoint)]
            for name in removed:
                (checkpoint / name).unlink(missing_ok=True)
        if removed:
            log.info("removed what an interrupted checkpoint or consolidate left: %s", ", ".join(removed))
        yield ""


def _folder_id(checkpoint: Path) -> tuple[int, int] | None:
    try:
        stat = checkpoint.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


# How many checkpoints a consolidate running beside training reads before giving up: each was rotated
# away while it was being read (a run saving faster than the weights can be read).
ROTATED_TRIES = 5


def consolidate(path: str | Path, overwrite: bool = False) -> Path:
    """Write ``model.safetensors`` (the whole weights, in their training dtype) into the DCP
    checkpoint ``path`` (or the latest of the run ``path``); one process, no process group.
    Returns the checkpoint folder, now readable by every command that reads checkpoints.

    Holds the run's write lock, as ``rdepth train`` does; while a training run holds it, reads beside it:
    a checkpoint that the run's ``--keep-last`` rotation removes (or a re-save replaces) while it is being
    read is read again from the newest checkpoint when ``path`` is the run, and is a one-line error when
    ``path`` names that checkpoint. ``model.safetensors`` is written under a temporary name
    (:func:`rdepth.io.atomic_path`) and renamed into place: never half-written; a kill leaves the
    temporary file, which the next consolidate or training start removes."""
    checkpoint = _checkpoint_of(path)
    follow_latest = checkpoint != Path(path)  # given the run folder: its newest checkpoint, whichever by then
    with _run_lock(checkpoint) as holder:
        for _ in range(ROTATED_TRIES):
            folder = _folder_id(checkpoint)
            try:
                _write_weights(checkpoint, overwrite)
                return checkpoint
            except (RdepthError, OSError):
                now = _folder_id(checkpoint)
                if not holder or now is not None and now == folder:
                    raise  # the checkpoint is still the one being read: its own error
            # removed by the rotation (or saved again) of the training run that holds the lock
            if now is None and not follow_latest:
                raise RdepthError(f"checkpoint {checkpoint} was removed while being read (the --keep-last rotation "
                                  f"of {holder}, which is training the run): consolidate a newer one, or pass "
                                  f"--checkpoint {checkpoint.parent.parent} for the newest") from None
            log.info("%s was removed or replaced while being read (by %s): reading %s", checkpoint.name, holder,
                     "the newest checkpoint" if follow_latest else "it again")
            checkpoint = _checkpoint_of(path)
        raise RdepthError(f"{path}: {ROTATED_TRIES} checkpoints in a row were removed while being read (the rotation "
                          f"of {holder}): run consolidate after the training, or train with a larger --keep-last")


def _write_weights(checkpoint: Path, overwrite: bool) -> None:
    """:func:`consolidate` of one checkpoint folder: its config, shapes, dtypes and finiteness checked, then
    ``model.safetensors`` written atomically."""
    import torch.distributed.checkpoint as dcp
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from rdepth.model import RecurrentLM

    target = checkpoint / "model.safetensors"
    if target.exists() and not overwrite:
        raise RdepthError(f"{target} exists already (pass --overwrite to write it again)")
    config = ckpt.load_model_config(checkpoint)
    try:
        metadata = dcp.FileSystemReader(str(checkpoint / DCP_DIR)).read_metadata().state_dict_metadata
    except _failures() as exc:
        raise RdepthError(f"distributed checkpoint {checkpoint / DCP_DIR} is unreadable ({_reason(exc)}): corrupt") \
            from None
    with torch.device("meta"):
        shapes = {name: tuple(tensor.shape) for name, tensor in RecurrentLM(config).state_dict().items()}
    found = {key[len("model."):]: meta for key, meta in metadata.items() if key.startswith("model.")}
    if set(found) != set(shapes):
        differ = sorted(set(found) ^ set(shapes))[:3]
        raise RdepthError(f"distributed checkpoint {checkpoint / DCP_DIR} does not hold the weights of the model in "
                          f"its config.json (differ: {', '.join(differ)}): corrupt")
    for name, meta in sorted(found.items()):
        if tuple(meta.size) != shapes[name]:
            raise RdepthError(f"distributed checkpoint {checkpoint / DCP_DIR} does not fit its config.json: {name} is "
                              f"{list(meta.size)}, the config's model has {list(shapes[name])} (another run's weights?)")
        if not meta.properties.dtype.is_floating_point:
            raise RdepthError(f"distributed checkpoint {checkpoint / DCP_DIR}: {name} is {meta.properties.dtype}, "
                              "not a floating-point weight: corrupt")
    weights = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for name, meta in found.items()}
    try:
        with warnings.catch_warnings(), _quiet_dcp_logs():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": weights}, checkpoint_id=checkpoint / DCP_DIR, no_dist=True)
    except _failures() as exc:
        raise RdepthError(f"cannot read the weights of {checkpoint / DCP_DIR} ({_reason(exc)}): corrupt") from None
    for name, tensor in sorted(weights.items()):
        if not bool(torch.isfinite(tensor).all()):
            raise RdepthError(f"distributed checkpoint {checkpoint / DCP_DIR}: {name} holds NaN or infinite values: "
                              "nothing written")
    # parents=False: a folder rotated away meanwhile is an error here, never re-created holding weights alone
    with atomic_path(target, parents=False) as temporary:
        try:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(temporary), metadata={"format": "pt"})
        except SafetensorError as exc:  # wraps the OSError of a full disk, or of a folder removed meanwhile
            raise RdepthError(f"cannot write {target}: {' '.join(str(exc).split())[:200]}") from None


@dataclass
class ConsolidateConfig:
    """One ``rdepth consolidate``: a sharded checkpoint as the usual safetensors one."""

    checkpoint: str = option("", "a --parallel fsdp checkpoint folder, or its run folder (the latest checkpoint)",
                             required=True)
    overwrite: bool = option(False, "write model.safetensors again where it exists")

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise RdepthError("consolidate: --checkpoint must be a non-empty path")

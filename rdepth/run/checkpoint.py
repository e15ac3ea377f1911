"""Checkpoints: a folder per step, written atomically, loadable without pickles of code.

Layout of a run directory::

    RUN/config.json                     resolved model + train config
    RUN/tokenizer/                      the tokenizer the data was prepared with
    RUN/checkpoints/step_000100/
        model.safetensors               weights
        config.json                     model config (rebuilds the model alone)
        trainer.pt                      optimizer state and RNG (weights_only load)
        state.json                      step, tokens seen, data position, metrics
    RUN/checkpoints/latest              name of the newest complete checkpoint

A checkpoint folder is written under a temporary name and renamed into place,
so a crash or kill mid-write leaves every earlier checkpoint intact. Rotation
(:func:`rotate_checkpoints`, ``rdepth train --keep-last``) removes a folder the
same way in reverse: renamed out of the listing, then deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.io import is_leftover_tmp, json_text, ordinary_mode, read_json_object, write_json, write_text

STEP_PATTERN = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def publish_folder(staging: Path, final: Path) -> None:
    """Rename the finished ``staging`` folder to ``final``; a ``final`` already there (the same step
    saved again) is replaced whole, never merged."""
    if final.exists():
        old = final.parent / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    model_config: ModelConfig,
    trainer_state: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write ``RUN/checkpoints/step_XXXXXX`` atomically and point ``latest`` at it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
    try:
        weights = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
        try:
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
            if trainer_state is not None:
                torch.save(trainer_state, staging / "trainer.pt")
        except (SafetensorError, RuntimeError) as exc:  # both wrap the OSError of a full or read-only disk
            raise RdepthError(f"cannot write checkpoint {final}: {' '.join(str(exc).split())[:200]} "
                              "(disk full or not writable?); earlier checkpoints are intact") from None
        # standard JSON: the config, read back as input, must be finite; a non-finite number in the state is null
        (staging / "config.json").write_text(json_text(model_config.to_dict(), final, strict=True, indent=2) + "\n")
        (staging / "state.json").write_text(json_text({"step": step, **(state or {})}, final, indent=2) + "\n")
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            ordinary_mode(path)  # safetensors writes 0600; a checkpoint is an ordinary file
        publish_folder(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    write_text(root / "latest", final.name + "\n")
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_PATTERN.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a checkpoint path, a ``checkpoints`` folder or a run folder."""
    path = Path(path)
    if not path.exists():
        raise RdepthError(f"checkpoint not found: {path}")
    if (path / "model.safetensors").exists() or (path / "config.json").exists() and not (path / "checkpoints").exists():
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        name = read_latest(latest)
        candidate = run_dir / "checkpoints" / name
        if candidate.is_dir():
            return candidate
    found = list_checkpoints(run_dir)
    if not found:
        raise RdepthError(f"no checkpoint in {path}")
    return found[-1]


def read_latest(latest: Path) -> str:
    """The checkpoint name in ``checkpoints/latest``: a one-line error unless it is a
    ``step_N`` name of this run's folder (never a path that leads elsewhere)."""
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise RdepthError(f"{latest} is not a checkpoint name: corrupt") from None
    if not STEP_PATTERN.match(name):
        raise RdepthError(f"{latest} names {name[:60]!r}, not a step_N checkpoint of this run: corrupt")
    return name


# safetensors' save_file writes its file as ``.tmpXXXXXX`` in the target's folder, then renames it
SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


def weight_temp_files(checkpoint: Path) -> list[Path]:
    """The temporary files of ``model.safetensors`` that a killed ``rdepth consolidate`` left in a checkpoint
    folder: ``.model.safetensors.XXXXXXXX.tmp`` (:func:`rdepth.io.atomic_path`; ``.model.safetensors.tmp``,
    the fixed name of earlier versions) and safetensors' own ``.tmpXXXXXX`` (the one a kill mid-write leaves
    full-size: :data:`SAFETENSORS_TMP`), and those of ``exit_gate.safetensors`` a killed ``rdepth gate`` left
    (``.exit_gate.safetensors.XXXXXXXX.tmp``); rdepth writes nothing else into a finished checkpoint."""
    if checkpoint.is_symlink() or not checkpoint.is_dir():
        return []

    def is_temp(path: Path) -> bool:
        if path.name.startswith((".model.safetensors.", ".exit_gate.safetensors.")) and is_leftover_tmp(path):
            return True
        return (path.name == ".model.safetensors.tmp" or bool(SAFETENSORS_TMP.match(path.name))) \
            and path.is_file() and not path.is_symlink()

    return sorted(path for path in checkpoint.iterdir() if is_temp(path))


def clean_debris(run_dir: str | os.PathLike) -> list[str]:
    """Remove what a killed :func:`save_checkpoint` left behind (``.step_N.*`` staging folders), and what
    a killed ``rdepth consolidate`` left in a checkpoint (:func:`weight_temp_files`); a checkpoint caught
    between its two renames (only ``.step_N.old`` left) is put back first.
    Call it only while holding the run folder's lock. Returns the names removed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        if STEP_PATTERN.match(path.name):
            for temp in weight_temp_files(path):
                temp.unlink(missing_ok=True)
                removed.append(f"{path.name}/{temp.name}")
            continue
        if not path.name.startswith(".step_"):
            continue
        if path.name.endswith(".old"):
            final = root / path.name[1:-len(".old")]
            if STEP_PATTERN.match(final.name) and not final.exists() and (path / "model.safetensors").is_file():
                os.replace(path, final)
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


# What save_checkpoint writes into a checkpoint folder: rotation removes only folders holding nothing else.
# A sharded run's (rdepth train --parallel fsdp) holds dcp/ instead of trainer.pt (rdepth.train.dcp).
CHECKPOINT_FILES = frozenset({"model.safetensors", "config.json", "trainer.pt", "state.json", "dcp"})


def is_checkpoint_folder(path: Path) -> bool:
    """True for a real folder named ``step_N`` holding model.safetensors (or dcp/) and only the files
    :func:`save_checkpoint` writes, or a temporary file of ``rdepth consolidate`` (:func:`weight_temp_files`)
    (never a link, never a folder with anything of someone else's)."""
    if path.is_symlink() or not path.is_dir() or not STEP_PATTERN.match(path.name):
        return False
    names = {entry.name for entry in path.iterdir()} - {temp.name for temp in weight_temp_files(path)}
    return bool(names & {"model.safetensors", "dcp"}) and names <= CHECKPOINT_FILES


def is_milestone(checkpoint: Path, every: int | None) -> bool:
    """A checkpoint rotation keeps: saved as one (``"milestone": true`` in its state.json), or, with
    ``every``, at a step on that grid."""
    state = checkpoint / "state.json"
    try:
        marked = json.loads(state.read_text()).get("milestone") is True if state.is_file() else False
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, OSError):
        marked = False
    return marked or (every is not None and checkpoint_step(checkpoint) % every == 0)


def remove_checkpoint(checkpoint: Path) -> None:
    """Delete a checkpoint folder whole: renamed to ``.step_N.removing`` first (one atomic step, after
    which it is no longer listed), then removed; a kill in between leaves debris that
    :func:`clean_debris` removes at the next start, never a half checkpoint."""
    if not is_checkpoint_folder(checkpoint):
        raise RdepthError(f"{checkpoint} is not a checkpoint folder written by rdepth: not removed")
    doomed = checkpoint.parent / f".{checkpoint.name}.removing"
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        os.replace(checkpoint, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    finally:  # Ctrl-C or SIGTERM (raised like it) while removing: finish it, then stop as asked
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)


def rotate_checkpoints(run_dir: str | os.PathLike, keep_last: int, milestone_every: int | None = None,
                       protect: tuple[Path, ...] = ()) -> list[str]:
    """Remove the run's checkpoints older than its newest ``keep_last``, except milestones
    (:func:`is_milestone`), those in ``protect`` (e.g. the one a run resumed from), the one
    ``latest`` names, and any folder :func:`is_checkpoint_folder` does not recognise.
    ``keep_last`` 0 keeps everything. Call it only while holding the run folder's lock.
    Returns the names removed."""
    if keep_last < 0:
        raise RdepthError(f"keep_last must be >= 0, got {keep_last}")
    found = list_checkpoints(run_dir)
    if keep_last == 0 or len(found) <= keep_last:
        return []
    root = Path(run_dir) / "checkpoints"
    kept = {path.resolve() for path in protect}
    latest = root / "latest"
    if latest.is_file():
        kept.add((root / read_latest(latest)).resolve())
    removed = []
    for checkpoint in found[:-keep_last]:
        if checkpoint.resolve() in kept or is_milestone(checkpoint, milestone_every) \
                or not is_checkpoint_folder(checkpoint):
            continue
        remove_checkpoint(checkpoint)
        removed.append(checkpoint.name)
    return removed


def find_checkpoints(paths: list[str | os.PathLike]) -> list[Path]:
    """Checkpoint folders from checkpoint paths and run folders (every checkpoint of a run),
    ordered by training step, duplicates dropped."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        run_list = list_checkpoints(path.parent if path.name == "checkpoints" else path)
        for checkpoint in run_list or [resolve_checkpoint(path)]:
            if checkpoint.resolve() not in {p.resolve() for p in found}:
                found.append(checkpoint)
    if not found:
        raise RdepthError("no checkpoints given")
    return sorted(found, key=lambda p: (checkpoint_step(p), str(p)))


def checkpoint_step(checkpoint: Path) -> int:
    """Training step of a checkpoint folder (state.json, else its step_N name, else -1)."""
    state = checkpoint / "state.json"
    if state.exists():
        try:
            return int(json.loads(state.read_text())["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    match = re.search(r"(\d+)$", checkpoint.name)
    return int(match.group(1)) if match else -1


def is_rdepth_run(path: str | os.PathLike) -> bool:
    """True for an rdepth run folder (``checkpoints/``) or one of its checkpoint folders."""
    path = Path(path)
    return (path / "checkpoints").is_dir() or (
        (path / "state.json").is_file() and (path / "model.safetensors").is_file()
    )


def load_model_config(checkpoint: Path) -> ModelConfig:
    return ModelConfig.from_dict(read_json_object(checkpoint / "config.json", "checkpoint config"))


def check_weight_values(source: str | Path, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor floating point and finite: integer weights cast to float (all zeros for a model's
    small values) and NaN weights load without a shape error and give a silently useless model."""
    for name, tensor in sorted(weights.items()):
        if not tensor.is_floating_point():
            raise RdepthError(f"weights in {source}: {name} is stored as {str(tensor.dtype)[6:]}, not a floating-point "
                              "type: corrupt")
        if not bool(torch.isfinite(tensor).all()):
            raise RdepthError(f"weights in {source}: {name} holds NaN or infinite values: corrupt or diverged")


def load_weights(checkpoint: Path, model: torch.nn.Module, assign: bool = False) -> None:
    """Load ``model.safetensors`` into ``model``; mismatches and corruption are one-line errors.
    ``assign``: the loaded tensors become the parameters (cast to the model's dtypes), so ``model`` may be
    built on the meta device, with no memory or initialisation spent on weights about to be replaced."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = checkpoint / "model.safetensors"
    if not weights_path.exists() and (checkpoint / "dcp").is_dir():
        raise RdepthError(f"checkpoint {checkpoint} is sharded (rdepth train --parallel fsdp): convert it first with "
                          f"rdepth consolidate --checkpoint {checkpoint}")
    if not weights_path.exists():
        raise RdepthError(f"checkpoint {checkpoint} has no model.safetensors")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise RdepthError(f"checkpoint weights {weights_path} are corrupt or truncated ({exc})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise RdepthError(
            f"checkpoint {checkpoint} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise RdepthError(
                f"checkpoint {checkpoint} does not match the model: {name} has shape "
                f"{tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
            )
    # load_state_dict would cast integer weights silently (a uniform model) and keep NaNs (ce nan, exit 0)
    check_weight_values(weights_path, weights)
    if assign:
        weights = {name: tensor.to(expected[name].dtype) for name, tensor in weights.items()}
    model.load_state_dict(weights, assign=assign)


def run_identity(checkpoint: Path) -> dict[str, Any]:
    """What identifies the weights a result was computed on: the SHA-256 of ``model.safetensors``
    and the checkpoint's model config. Saved in exit profiles; applying one to other weights is refused
    (:func:`check_run_identity`)."""
    from rdepth.data.shards import file_sha256

    checkpoint = Path(checkpoint)
    return {"weights_sha256": file_sha256(checkpoint / "model.safetensors"),
            "model_config": load_model_config(checkpoint).to_dict()}


def check_run_identity(recorded: Any, checkpoint: Path, what: str, force_flag: str) -> None:
    """A one-line error unless ``recorded`` (a :func:`run_identity` saved with ``what``) names the weights
    of ``checkpoint``; a file that records none is refused the same way (it cannot be checked)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("weights_sha256"), str):
        raise RdepthError(f"{what} records no run identity (weights SHA-256), so it cannot be checked against "
                          f"{checkpoint}: calibrate again, or pass {force_flag} to apply it anyway")
    current = run_identity(checkpoint)
    if recorded["weights_sha256"] != current["weights_sha256"]:
        same_shape = recorded.get("model_config") == current["model_config"]
        raise RdepthError(f"{what} was made for other weights than {checkpoint / 'model.safetensors'}"
                          f"{' (a model of the same shape)' if same_shape else ''}: calibrate for this run, or "
                          f"pass {force_flag} to apply it anyway")


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Rebuild a model from a checkpoint (or run) folder: returns ``(model, config)``."""
    from rdepth.config import check_fits_memory
    from rdepth.model import RecurrentLM

    checkpoint = resolve_checkpoint(path)
    config = load_model_config(checkpoint)
    check_fits_memory(config, f"checkpoint config {checkpoint / 'config.json'}")
    with torch.device("meta"):  # no memory and no initialisation for weights the checkpoint replaces
        model = RecurrentLM(config)
    load_weights(checkpoint, model, assign=True)
    return model.to(device).eval(), config


def check_state(state: dict[str, Any], state_path: Path, checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's state.json: its step an integer that matches the folder's name, its token count an
    integer, its training config an object."""
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RdepthError(f"checkpoint state {state_path}: step must be an integer >= 0, got {step!r}")
    match = STEP_PATTERN.match(checkpoint.name)
    if match and int(match.group(1)) != step:
        raise RdepthError(f"checkpoint state {state_path} says step {step}, its folder says "
                          f"{int(match.group(1))}: corrupt")
    tokens = state.get("tokens_seen", 0)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise RdepthError(f"checkpoint state {state_path}: tokens_seen must be an integer >= 0, got {tokens!r}")
    if "train_config" in state and not isinstance(state["train_config"], dict):
        raise RdepthError(f"checkpoint state {state_path}: train_config must be an object")
    return state


def load_trainer_state(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer_state, state)`` of a checkpoint, loaded without unpickling code.

    Both are checked field by field: a wrongly typed field, or a step that is not the
    one in the folder's name, is a one-line error (never a traceback, never a silent
    resume from the wrong step).
    """
    trainer_path = checkpoint / "trainer.pt"
    state_path = checkpoint / "state.json"
    if not trainer_path.exists() and (checkpoint / "dcp").is_dir():
        raise RdepthError(f"checkpoint {checkpoint} is sharded: resume it as it was trained, with --parallel fsdp "
                          "under torchrun")
    if not trainer_path.exists() or not state_path.exists():
        raise RdepthError(f"checkpoint {checkpoint} has no optimizer state to resume from")
    try:
        with warnings.catch_warnings():  # torch warns about a damaged file before it fails: the error says it
            warnings.simplefilter("ignore")
            trainer_state = torch.load(trainer_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        raise RdepthError(f"checkpoint optimizer state {trainer_path} is corrupt ({type(exc).__name__})") from None
    if not isinstance(trainer_state, dict) or not isinstance(trainer_state.get("optimizer"), dict):
        raise RdepthError(f"checkpoint optimizer state {trainer_path} holds no optimizer state dict: corrupt")
    optimizer = trainer_state["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
        raise RdepthError(f"checkpoint optimizer state {trainer_path} is malformed: corrupt")
    rng = trainer_state.get("torch_rng")
    if rng is not None and not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8):
        raise RdepthError(f"checkpoint optimizer state {trainer_path}: torch_rng is not a uint8 tensor: corrupt")
    state = check_state(read_json_object(state_path, "checkpoint state"), state_path, checkpoint)
    return trainer_state, state


def write_run_config(run_dir: Path, model_config: ModelConfig, train_config_dict: dict, **extra: Any) -> None:
    """``RUN/config.json``: the resolved model and train config (plus ``extra`` sections)."""
    write_json(run_dir / "config.json", {"model": model_config.to_dict(), "train": train_config_dict, **extra},
               strict=True)


def read_run_config(run_dir: Path) -> dict:
    """``RUN/config.json`` (an empty dict when there is none); its sections must be objects."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return {}
    saved = read_json_object(path, "run config")
    for section in ("model", "train"):
        if section in saved and not isinstance(saved[section], dict):
            raise RdepthError(f"run config {path}: {section} must be an object")
    return saved

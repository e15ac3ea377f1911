"""The learned exit gate on disk: ``exit_gate.safetensors`` beside a checkpoint, tied to its model.

:func:`save_gate` writes it next to ``model.safetensors``; its metadata ties it to that model: the
SHA-256 of the weights file, the SHA-256 of the model config and the shape (groups, ``d_model``).
:func:`load_gate` refuses a gate made for other weights or another shape, a missing one and a damaged one
with a one-line error. A gate is bound to its model wherever it is named from: ``load_gate(folder,
drives=checkpoint)`` refuses a gate (a copy, another run's) trained for any model but the one it is to drive.
The metadata also holds the SHA-256 of the gate's own tensors (:func:`tensors_sha256`), so a gate whose bytes
changed is refused, and an exit profile records it (:func:`gate_sha256`) to refuse a gate trained anew.
The gate itself is :class:`rdepth.exits.gate.ExitGate`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.exits.gate import ExitGate

GATE_FILE = "exit_gate.safetensors"
FORMAT = "2"  # 2: the tensors' SHA-256 in the metadata (format 1 had none: retrained with rdepth gate --overwrite)
OVERWRITE_FLAG = "--overwrite"


def tensors_sha256(weight, bias) -> str:
    """SHA-256 of a gate's tensors as float32 bytes (weight then bias): its content checksum."""
    digest = hashlib.sha256()
    for tensor in (weight, bias):
        digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def gate_sha256(gate: ExitGate) -> str:
    """The SHA-256 that identifies ``gate`` (its tensors'): what an exit profile records."""
    return gate.metadata.get("tensors_sha256") or tensors_sha256(gate.weight, gate.bias)


def config_sha256(model_config: dict) -> str:
    """SHA-256 of a model config dict in canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest()


def model_identity(checkpoint: Path) -> dict[str, str]:
    """What ties a gate to ``checkpoint``'s model: weights and config SHA-256, groups and width."""
    from rdepth.run.checkpoint import run_identity

    identity = run_identity(checkpoint)
    config = identity["model_config"]
    from rdepth.config import ModelConfig

    groups = len(ModelConfig.from_dict(config).group_specs)
    return {"weights_sha256": identity["weights_sha256"], "model_config_sha256": config_sha256(config),
            "n_groups": str(groups), "d_model": str(config["d_model"])}


def gate_path(checkpoint: str | os.PathLike) -> Path:
    """Where the gate of a checkpoint (or of a run folder's latest checkpoint) lives."""
    from rdepth.run.checkpoint import resolve_checkpoint

    return resolve_checkpoint(checkpoint) / GATE_FILE


def check_replaceable(checkpoint: str | os.PathLike, overwrite: bool) -> None:
    """A one-line error when ``checkpoint`` holds a gate already and ``overwrite`` is false (a profile
    calibrated with the old gate would refuse the new one)."""
    path = gate_path(checkpoint)
    if path.exists() and not overwrite:
        raise RdepthError(f"{path} exists (an exit profile calibrated with it refuses another gate); pass "
                          f"{OVERWRITE_FLAG} to replace it")


def save_gate(gate: ExitGate, checkpoint: str | os.PathLike, extra: dict[str, str] | None = None, *,
              overwrite: bool = True) -> Path:
    """Write ``gate`` beside ``checkpoint``'s weights (atomically), its metadata the model's identity, the
    tensors' checksum and ``extra``. An existing gate is replaced only with ``overwrite`` (one-line error
    otherwise, also when another writer put one there meanwhile). Returns the file."""
    from safetensors.torch import save_file

    from rdepth.io import atomic_path
    from rdepth.run.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(checkpoint)
    check_replaceable(folder, overwrite)
    metadata = {**(extra or {}), "format": FORMAT, **model_identity(folder),
                "tensors_sha256": tensors_sha256(gate.weight, gate.bias)}
    if int(metadata["n_groups"]) != gate.n_groups or int(metadata["d_model"]) != gate.d_model:
        raise RdepthError(f"exit gate: {gate.n_groups} head(s) of width {gate.d_model} do not fit the model of "
                          f"{folder} ({metadata['n_groups']} groups, d_model {metadata['d_model']})")
    path = folder / GATE_FILE
    with atomic_path(path, overwrite=overwrite) as tmp:
        save_file({"weight": gate.weight.detach().float().contiguous().cpu(),
                   "bias": gate.bias.detach().float().contiguous().cpu()}, str(tmp), metadata=metadata)
    _LOADED.pop(str(path), None)
    return path


# path -> (stat of the gate and the weights, gate): a sweep builds a policy per group per batch
_LOADED: dict[str, tuple[tuple, ExitGate]] = {}


def _stat(path: Path) -> tuple:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def load_gate(checkpoint: str | os.PathLike, drives: str | os.PathLike | None = None) -> ExitGate:
    """The gate saved beside ``checkpoint`` (a checkpoint or run folder), checked against its model and, with
    ``drives`` (the checkpoint or run folder of the model it is to run on), against that model.

    One-line errors: no gate there, a damaged file (its tensors' checksum differs), a gate trained for other
    weights or another model config, a shape that does not fit, a gate for another model than ``drives``."""
    from safetensors import SafetensorError, safe_open

    from rdepth.run.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(checkpoint)
    path = folder / GATE_FILE
    if not path.is_file():
        raise RdepthError(f"exit policy learned: {folder} has no trained exit gate ({GATE_FILE}); train one with "
                          f"rdepth gate --checkpoint {checkpoint} --data DATA")
    weights = folder / "model.safetensors"
    stamp = (_stat(path), _stat(weights) if weights.is_file() else None)
    cached = _LOADED.get(str(path))
    if cached is not None and cached[0] == stamp:
        return _check_drives(cached[1], folder, drives)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (no mapping)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise RdepthError(f"exit gate {path} is corrupt or truncated ({exc})") from None
    if metadata.get("format") == "1" and set(tensors) == {"weight", "bias"}:
        raise RdepthError(f"exit gate {path} has format 1, with no checksum of its tensors: train it again with "
                          f"rdepth gate --checkpoint {checkpoint} --data DATA {OVERWRITE_FLAG}")
    if metadata.get("format") != FORMAT or set(tensors) != {"weight", "bias"}:
        raise RdepthError(f"exit gate {path} is not an rdepth exit gate of format {FORMAT} (tensors "
                          f"{sorted(tensors)}, format {metadata.get('format')!r})")
    current = model_identity(folder)
    if metadata.get("model_config_sha256") != current["model_config_sha256"]:
        raise RdepthError(f"exit gate {path} was trained for another model (its config differs from "
                          f"{folder / 'config.json'}): train a gate for this run with rdepth gate")
    if metadata.get("weights_sha256") != current["weights_sha256"]:
        raise RdepthError(f"exit gate {path} was trained for other weights than {weights} (a model of the same "
                          "shape): train a gate for this run with rdepth gate")
    if tensors_sha256(tensors["weight"], tensors["bias"]) != metadata.get("tensors_sha256"):
        raise RdepthError(f"exit gate {path} is corrupt: its tensors' SHA-256 differs from the one it was saved "
                          f"with; train it again with rdepth gate {OVERWRITE_FLAG}")
    gate = ExitGate(tensors["weight"], tensors["bias"], metadata, str(path))
    if gate.n_groups != int(current["n_groups"]) or gate.d_model != int(current["d_model"]):
        raise RdepthError(f"exit gate {path} has {gate.n_groups} head(s) of width {gate.d_model}; the model has "
                          f"{current['n_groups']} group(s) of width {current['d_model']}")
    _LOADED[str(path)] = (stamp, gate)
    return _check_drives(gate, folder, drives)


def _check_drives(gate: ExitGate, folder: Path, drives: str | os.PathLike | None) -> ExitGate:
    """``gate`` (checked against ``folder``'s model) when it was trained for the model of ``drives`` too."""
    if drives is None:
        return gate
    from rdepth.run.checkpoint import resolve_checkpoint

    target = resolve_checkpoint(drives)
    if target.resolve() == folder.resolve():
        return gate
    current = model_identity(target)
    if any(gate.metadata.get(key) != current[key] for key in ("weights_sha256", "model_config_sha256")):
        raise RdepthError(f"exit gate {gate.source} was trained for the model of {folder}, not for {target}'s "
                          f"(their weights or configs differ): train a gate for it with rdepth gate --checkpoint "
                          f"{drives}")
    return gate


def check_gate_option(policy: str | None, options: dict, checkpoint: str | os.PathLike) -> None:
    """``--exit learned --exit-options gate=FOLDER`` on ``checkpoint``'s model: a one-line error unless that
    gate was trained for this model (another model's gate, or a damaged one, never drives it)."""
    gate = options.get("gate")
    if policy == "learned" and isinstance(gate, (str, os.PathLike)) and str(gate) != str(checkpoint):
        load_gate(gate, drives=checkpoint)

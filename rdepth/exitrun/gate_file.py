"""The learned exit gate on disk: ``exit_gate.safetensors`` beside a checkpoint, tied to its model.

:func:`save_gate` writes it next to ``model.safetensors``; its metadata ties it to that model: the
SHA-256 of the weights file, the SHA-256 of the model config and the shape (groups, ``d_model``).
:func:`load_gate` refuses a gate made for other weights or another shape, a missing one and a damaged one
with a one-line error. The gate itself is :class:`rdepth.exits.gate.ExitGate`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.exits.gate import ExitGate

GATE_FILE = "exit_gate.safetensors"
FORMAT = "1"


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


def save_gate(gate: ExitGate, checkpoint: str | os.PathLike, extra: dict[str, str] | None = None) -> Path:
    """Write ``gate`` beside ``checkpoint``'s weights (atomically, replacing an older gate), its metadata the
    model's identity plus ``extra``. Returns the file."""
    from safetensors.torch import save_file

    from rdepth.io import atomic_path
    from rdepth.run.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(checkpoint)
    metadata = {**(extra or {}), "format": FORMAT, **model_identity(folder)}
    if int(metadata["n_groups"]) != gate.n_groups or int(metadata["d_model"]) != gate.d_model:
        raise RdepthError(f"exit gate: {gate.n_groups} head(s) of width {gate.d_model} do not fit the model of "
                          f"{folder} ({metadata['n_groups']} groups, d_model {metadata['d_model']})")
    path = folder / GATE_FILE
    with atomic_path(path) as tmp:
        save_file({"weight": gate.weight.detach().float().contiguous().cpu(),
                   "bias": gate.bias.detach().float().contiguous().cpu()}, str(tmp), metadata=metadata)
    _LOADED.pop(str(path), None)
    return path


# path -> (stat of the gate and the weights, gate): a sweep builds a policy per group per batch
_LOADED: dict[str, tuple[tuple, ExitGate]] = {}


def _stat(path: Path) -> tuple:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def load_gate(checkpoint: str | os.PathLike) -> ExitGate:
    """The gate saved beside ``checkpoint`` (a checkpoint or run folder), checked against its model.

    One-line errors: no gate there, a damaged file, a gate trained for other weights or another model
    config, a shape that does not fit."""
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
        return cached[1]
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise RdepthError(f"exit gate {path} is corrupt or truncated ({exc})") from None
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
    gate = ExitGate(tensors["weight"], tensors["bias"], metadata, str(path))
    if gate.n_groups != int(current["n_groups"]) or gate.d_model != int(current["d_model"]):
        raise RdepthError(f"exit gate {path} has {gate.n_groups} head(s) of width {gate.d_model}; the model has "
                          f"{current['n_groups']} group(s) of width {current['d_model']}")
    _LOADED[str(path)] = (stamp, gate)
    return gate

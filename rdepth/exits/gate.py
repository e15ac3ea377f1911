"""The learned exit gate: a small head per group on the loop state, saved beside a checkpoint.

After loop step ``s`` of group ``g`` the gate reads a token's previous and new states and gives the
probability that the token's prediction will not change from here (up to the step cap it was trained
with). Its input (:func:`gate_features`, ``[A, d + 1]``) is the new state rms-normed (no gain) and the log
of the relative update ``||x^(s) - x^(s-1)|| / ||x^(s-1)||``; the head is a linear probe and a sigmoid:
``p = sigmoid(features @ weight[g] + bias[g])``, O(d) per token-step, per row, no host read. The ``learned``
policy (:mod:`rdepth.exits.policies`) stops a token when ``1 - p < tau``.

The gate is trained on a frozen model from its own recorded iterates (:mod:`rdepth.calibrate.gate`,
``rdepth gate``) and saved as ``exit_gate.safetensors`` in the checkpoint folder, next to
``model.safetensors``; its metadata ties it to that model: the SHA-256 of the weights file, the SHA-256
of the model config and the shape (groups, ``d_model``). :func:`load_gate` refuses a gate made for other
weights or another shape, a missing one and a damaged one with a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rdepth.errors import RdepthError

GATE_FILE = "exit_gate.safetensors"
FORMAT = "1"
EPS = 1e-6  # inside the rms norm and the log of the relative update


def gate_features(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The gate's input ``[..., d + 1]`` from ``prev`` = ``x^(s-1)`` and ``new`` = ``x^(s)`` (``[..., d]``):
    ``new`` rms-normed, then ``log(||new - prev|| / (||prev|| + eps) + eps)``; in float32 (float64 for
    float64 states). The same function builds the training rows and the policy's input."""
    dtype = torch.promote_types(new.dtype, torch.float32)
    prev, new = prev.to(dtype), new.to(dtype)
    normed = new * torch.rsqrt(new.pow(2).mean(-1, keepdim=True) + EPS)
    update = torch.linalg.vector_norm(new - prev, dim=-1) / (torch.linalg.vector_norm(prev, dim=-1) + EPS)
    return torch.cat([normed, torch.log(update + EPS).unsqueeze(-1)], dim=-1)


def stable_from(predictions: torch.Tensor) -> torch.Tensor:
    """long ``[N]``: per token the first step ``s`` (1-based) from which its prediction no longer changes up
    to the last recorded step. ``predictions``: ``[K, N]``, the prediction after steps 1..K.

    For a token right at step K this is the per-token oracle of :func:`rdepth.sweep.depth.oracle_steps`
    (the fewest steps from which it is right and stays right); for a token wrong at K, from where its
    answer stops changing."""
    if predictions.dim() != 2 or predictions.shape[0] < 1:
        raise RdepthError(f"exit gate: predictions must be [K, N] with K >= 1, got {tuple(predictions.shape)}")
    agrees = (predictions == predictions[-1]).flip(0).long().cumprod(0).flip(0)  # same as the last from s on
    return predictions.shape[0] - agrees.sum(0) + 1


@dataclass
class ExitGate:
    """A gate for a model with ``weight.shape[0]`` groups of ``weight.shape[1] - 1`` dimensions.

    weight: float ``[G, d + 1]``; bias: float ``[G]``; metadata: what it was trained for and on (strings,
    the safetensors header); source: where it was read from ("" when built in memory)."""

    weight: torch.Tensor
    bias: torch.Tensor
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = ""
    _placed: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.shape[1] < 2 or self.bias.shape != (self.weight.shape[0],):
            raise RdepthError(f"exit gate{self._where()}: weight {tuple(self.weight.shape)} and bias "
                              f"{tuple(self.bias.shape)} must be [groups, d + 1] and [groups]")
        if not (self.weight.is_floating_point() and bool(torch.isfinite(self.weight).all())
                and bool(torch.isfinite(self.bias).all())):
            raise RdepthError(f"exit gate{self._where()}: its weights are not finite floating-point numbers: corrupt")

    def _where(self) -> str:
        return f" {self.source}" if self.source else ""

    @property
    def n_groups(self) -> int:
        return self.weight.shape[0]

    @property
    def d_model(self) -> int:
        return self.weight.shape[1] - 1

    def check_state(self, group: int, state: torch.Tensor) -> None:
        """A one-line error unless the gate has a head for ``group`` and ``state`` ``[N, d]`` its width."""
        if group >= self.n_groups or state.shape[-1] != self.d_model:
            raise RdepthError(f"exit gate{self._where()} has {self.n_groups} group head(s) of width {self.d_model}; "
                              f"the model runs group {group} with width {state.shape[-1]}: a gate for another model")

    def probability(self, group: int, prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``[A]``: the probability that each token's prediction no longer changes after this step."""
        return torch.sigmoid(self.score(group, prev, new))

    def score(self, group: int, prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``[A]``: the gate's pre-sigmoid score, ``gate_features(prev, new) @ weight[group] + bias[group]``
        computed without building the features (the rule's hot path: ~16 ops per step, one of them the
        O(d) dot product, the rms norm applied to that dot product instead of to the state)."""
        dtype = torch.promote_types(new.dtype, torch.float32)
        if new.dtype != dtype or prev.dtype != dtype:  # no call when they are (the hot path)
            prev, new = prev.to(dtype), new.to(dtype)
        state_weight, update_weight, bias = self._head(group, new.device, dtype)
        inverse_rms = torch.rsqrt(new.pow(2).mean(-1) + EPS)  # (A,)
        update = torch.linalg.vector_norm(new - prev, dim=-1) / (torch.linalg.vector_norm(prev, dim=-1) + EPS)
        return (new @ state_weight) * inverse_rms + torch.log(update + EPS) * update_weight + bias

    def _head(self, group: int, device: torch.device, dtype: torch.dtype):
        """(state weight [d], update weight [], bias []) of ``group`` on ``device`` in ``dtype``, made once."""
        key = (group, device, dtype)
        if key not in self._placed:
            weight = self.weight[group].to(device, dtype)
            self._placed[key] = (weight[:-1].contiguous(), weight[-1].clone(), self.bias[group].to(device, dtype))
        return self._placed[key]


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


def random_gate(n_groups: int, d_model: int, *, seed: int = 0, scale: float = 1.0) -> ExitGate:
    """A gate with random weights (for tests and benchmarks: the rule's mechanics, not its quality)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_groups, d_model + 1, generator=generator, dtype=torch.float64) * scale / math.sqrt(d_model)
    return ExitGate(weight, torch.zeros(n_groups, dtype=torch.float64))

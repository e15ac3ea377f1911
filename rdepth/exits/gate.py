"""The learned exit gate: a small head per group on the loop state, saved beside a checkpoint.

After loop step ``s`` of group ``g`` the gate reads a token's previous and new states and gives the
probability that the token's prediction will not change from here (up to the step cap it was trained
with). Its input (:func:`gate_features`, ``[A, d + 1]``) is the new state rms-normed (no gain) and the log
of the relative update ``||x^(s) - x^(s-1)|| / ||x^(s-1)||``; the head is a linear probe and a sigmoid:
``p = sigmoid(features @ weight[g] + bias[g])``, O(d) per token-step, per row, no host read. The ``learned``
policy (:mod:`rdepth.exits.policies`) stops a token when ``1 - p < tau``.

The gate is trained on a frozen model from its own recorded iterates (:mod:`rdepth.calibrate.gate`,
``rdepth gate``) and saved beside the checkpoint by :mod:`rdepth.exitrun.gate_file` (the file and its ties
to the model). This module is the gate itself, with no file or run-folder code, so the exported model's
bundled code carries it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rdepth.errors import RdepthError

EPS = 1e-6  # inside the rms norm and the log of the relative update
_WIDE = (torch.float32, torch.float64)  # the dtypes the gate computes in as they come


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
        computed without building the features (the rule's hot path: 14 ops per step, one of them the
        O(d) dot product, the rms norm applied to that dot product instead of to the state, each term added
        with its weight in one ``addcmul``)."""
        if not (new.dtype in _WIDE and prev.dtype == new.dtype):  # no call when they are (the hot path)
            dtype = torch.promote_types(new.dtype, torch.float32)
            prev, new = prev.to(dtype), new.to(dtype)
        state_weight, update_weight, bias = self._head(group, new.device, new.dtype)
        update = torch.linalg.vector_norm(new - prev, dim=-1) / (torch.linalg.vector_norm(prev, dim=-1) + EPS)
        inverse_rms = torch.rsqrt(new.pow(2).mean(-1) + EPS)  # (A,); F.rms_norm is slower on a CPU at this size
        return torch.addcmul(torch.addcmul(bias, new @ state_weight, inverse_rms), torch.log(update + EPS),
                             update_weight)

    def _head(self, group: int, device: torch.device, dtype: torch.dtype):
        """(state weight [d], update weight [], bias []) of ``group`` on ``device`` in ``dtype``, made once."""
        key = (group, device, dtype)
        if key not in self._placed:
            weight = self.weight[group].to(device, dtype)
            self._placed[key] = (weight[:-1].contiguous(), weight[-1].clone(), self.bias[group].to(device, dtype))
        return self._placed[key]


def random_gate(n_groups: int, d_model: int, *, seed: int = 0, scale: float = 1.0) -> ExitGate:
    """A gate with random weights (for tests and benchmarks: the rule's mechanics, not its quality)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_groups, d_model + 1, generator=generator, dtype=torch.float64) * scale / math.sqrt(d_model)
    return ExitGate(weight, torch.zeros(n_groups, dtype=torch.float64))

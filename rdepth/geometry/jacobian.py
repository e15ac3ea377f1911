"""The own-state Jacobian of a loop step at its last iterate, and its leading eigenvalues.

A group's loop step maps the states of all positions ``[B, T, d]`` to new states. The *own-state*
Jacobian at position p is the ``[d, d]`` block d step(s)[p] / d s[p]: how a token's next state
responds to its own current state, the other positions held fixed. Near a fixed point its
eigenvalues say what the loop does per step: the modulus is the contraction per step along that
direction (< 1 contracts), the angle the turning per step (0 degrees: keeps going the same way,
180: flips back and forth, +-60-90: turns, the spiral the paper describes). A dominant eigenvalue
lambda gives consecutive steps Delta^(k+1) ~ lambda Delta^(k), so the consecutive-step cosine tends to
cos(angle(lambda)) when one real eigenvalue or one complex pair dominates.

Everything runs through the model's own :meth:`~rdepth.model.RecurrentLM.loop_step`
(``torch.func.jacrev`` of it): no second copy of the forward pass. The iterate comes from the
model's one forward (an observer records each group's last state); a group's input is rebuilt from
the observed states with :meth:`~rdepth.model.RecurrentLM.run_layers` and
:meth:`~rdepth.model.RecurrentLM.group_input` (the single-pass layers between groups).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.model.walk import StageWalk

# How many eigenvalues (largest modulus first) are saved per position.
TOP_EIGENVALUES = 6
# Memory the vectorised backward passes of one Jacobian may take (jacrev's chunk is sized to fit it)
JACOBIAN_BYTES = 2**31


def own_state_jacobian(step: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor,
                       chunk: int | None = None) -> torch.Tensor:
    """d step(states)[-1] / d states[-1]: the own-state Jacobian ``[d, d]`` of the last position.

    ``states`` ``[L, d]``: the positions up to and including the one of interest (a causal step
    reads no later position, so the prefix is exact). ``step``: ``[L, d] -> [L, d]``. ``chunk``: how
    many of the d backward passes run vectorised at once (None: all d; the rows are the same either
    way, only the memory differs).
    """
    if states.dim() != 2:
        raise RdepthError(f"own_state_jacobian expects states [L, d], got {tuple(states.shape)}")
    others = states[:-1]

    def last(own: torch.Tensor) -> torch.Tensor:
        return step(torch.cat([others, own.unsqueeze(0)]))[-1]

    return torch.func.jacrev(last, chunk_size=chunk)(states[-1])


def jacobian_chunk(model, group: int, rows: int, budget: int = JACOBIAN_BYTES) -> int | None:
    """The most backward passes of one loop step of ``group`` over ``rows`` positions that fit ``budget``
    bytes at once (None when all d do): each pass keeps, per position and looped layer, about the
    residual stream's few copies, the MLP's hidden activations and a row of attention weights."""
    config = model.config
    layers = len(config.group_specs[group].layers)
    element = next(model.parameters()).element_size()
    per_pass = rows * layers * (8 * config.d_model + 3 * config.hidden_width + 2 * config.n_head * rows) * element
    chunk = max(1, budget // max(per_pass, 1))
    return None if chunk >= config.d_model else chunk


def leading_eigenvalues(jacobian: torch.Tensor, count: int = TOP_EIGENVALUES) -> torch.Tensor:
    """The ``count`` eigenvalues of largest modulus (complex128, modulus descending, ties by angle)."""
    values = torch.linalg.eigvals(jacobian.double())
    order = sorted(range(values.numel()), key=lambda i: (-float(values[i].abs()), float(values[i].angle())))
    return values[order[:count]]


def eigen_rows(values: torch.Tensor) -> list[dict[str, float]]:
    """JSON rows of complex eigenvalues: real, imaginary, modulus, angle in degrees (-180, 180]."""
    rows = []
    for value in values.tolist():
        angle = math.degrees(math.atan2(value.imag, value.real))
        rows.append({"real": value.real, "imag": value.imag, "modulus": abs(value),
                     "angle_deg": 180.0 if angle == -180.0 else angle})
    return rows


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_spectra(per_position: list[list[dict[str, float]]]) -> dict[str, Any]:
    """A group's spectra over the sampled positions: the spectral radius (modulus of the leading
    eigenvalue) and the absolute angle of the leading eigenvalue, median/min/max over positions."""
    radius = [rows[0]["modulus"] for rows in per_position if rows]
    angle = [abs(rows[0]["angle_deg"]) for rows in per_position if rows]
    return {"spectral_radius": _stats(radius), "leading_angle_deg": _stats(angle)}


@torch.no_grad()
def group_fixed_points(model, idx: torch.Tensor, loop_counts, noise) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each group's last iterate ``[B, T, d]`` after ``loop_counts`` steps from ``noise`` and its
    input half ``W_e e`` ``[B, T, d]`` (:meth:`group_input`), from one forward of the model on ``idx``."""
    finals: dict[int, torch.Tensor] = {}
    counts = model.resolve_loop_counts(loop_counts)

    def observer(group, step, state, active):
        if step == counts[group]:
            finals[group] = state.detach().clone()

    model(idx, loop_counts=counts, noise=noise, observer=observer)
    walk = _ObservedWalk(model, finals)
    walk(model.embed(idx))
    return [finals[g] for g in range(model.n_groups)], [walk.inputs[g] for g in range(model.n_groups)]


class _ObservedWalk(StageWalk):
    """The model's walk with each group's loop replaced by its observed last iterate (``finals``), keeping
    what each group read: its input half ``W_e e`` (``inputs``)."""

    def __init__(self, model, finals: dict[int, torch.Tensor]):
        super().__init__(model)
        self.finals = finals
        self.inputs: dict[int, torch.Tensor] = {}

    def start(self, group, inputs):
        return None  # (no loop is run)

    def loop(self, group, state, projected):
        self.inputs[group] = projected
        return self.finals[group]


def spectra(model, idx: torch.Tensor, positions: list[int], loop_counts, noise,
            count: int = TOP_EIGENVALUES) -> list[dict[str, Any]]:
    """Leading eigenvalues of every group's own-state Jacobian at its last iterate.

    ``idx`` ``[B, T]`` windows; ``positions[b]``: the position sampled in window b (one per window).
    Returns per group ``{"eigenvalues": [per position: eigen_rows], **summarize_spectra}``.
    """
    if len(positions) > idx.shape[0]:
        raise RdepthError(f"{len(positions)} positions for {idx.shape[0]} windows")
    finals, inputs = group_fixed_points(model, idx, loop_counts, noise)
    # Only the state is differentiated: with the weights requiring grad, the vectorised backward passes
    # carried the weights' gradient paths too (21 GiB over the weights at 128 positions of Huginn-0125's
    # width on an H200, against 0.6 GiB frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        return _spectra(model, finals, inputs, positions, count)
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


def _spectra(model, finals, inputs, positions: list[int], count: int) -> list[dict[str, Any]]:
    result = []
    for group in range(model.n_groups):
        per_position = []
        for window, position in enumerate(positions):
            prefix = slice(0, position + 1)
            projected = inputs[group][window:window + 1, prefix]

            def step(states: torch.Tensor, projected=projected, group=group) -> torch.Tensor:
                return model.loop_step(group, states.unsqueeze(0), projected)[0]

            with torch.enable_grad(), warnings.catch_warnings():
                # vmap over attention's backward falls back to a loop on CPU: correct, just slower
                warnings.filterwarnings("ignore", message="There is a performance drop")
                jacobian = own_state_jacobian(step, finals[group][window, prefix],
                                              jacobian_chunk(model, group, position + 1))
            per_position.append(eigen_rows(leading_eigenvalues(jacobian.detach(), count)))
        result.append({"eigenvalues": per_position, **summarize_spectra(per_position)})
    return result

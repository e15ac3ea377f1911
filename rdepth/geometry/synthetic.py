"""Loop trajectories with known dynamics: the null controls the claim judges are checked against.

Each group g is a linear loop around its own fixed point p_g::

    x_g^(k+1) - p_g = r_g R(theta_g) (x_g^(k) - p_g)

with contraction ``r`` (step sizes shrink by r per step) and R(theta) a rotation by ``theta`` in
every coordinate pair (0,1), (2,3), ... (so cos(Delta^(k), Delta^(k+1)) = cos(theta) exactly, for
every token and step). The start x^(0) is p_g plus Gaussian noise of norm ~``noise`` (the random
initial state), and the next group's fixed point is p_{g+1} = p_g + ``drift`` u with u a random unit
vector per token: the hand-off drift, 0 for a model whose groups settle where the last one did.

:func:`trajectories` returns the iterates ``[K+1, N, d]`` per group (the layout of
:mod:`rdepth.geometry.metrics`); :func:`observe` feeds them to a
:class:`~rdepth.geometry.stream.GeometryObserver` as a model's forward would; :func:`zero_drift_control`
is the hand-off ratio a drift-free model with a run's own loop dynamics would read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rdepth.errors import RdepthError


@dataclass(frozen=True)
class LoopDynamics:
    """One group's loop: contraction per step, rotation per step (radians), start-noise norm."""

    contraction: float
    rotation: float = 0.0
    noise: float = 1.0


def _rotate(vectors: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate every coordinate pair (0,1), (2,3), ... of ``vectors`` [..., d] (d even) by ``angle``."""
    pairs = vectors.reshape(*vectors.shape[:-1], -1, 2)
    cos, sin = math.cos(angle), math.sin(angle)
    turned = torch.stack([cos * pairs[..., 0] - sin * pairs[..., 1], sin * pairs[..., 0] + cos * pairs[..., 1]], -1)
    return turned.reshape(vectors.shape)


def trajectories(groups: list[LoopDynamics], steps: int | list[int], drift: float, tokens: int = 64,
                 width: int = 16, state_scale: float = 10.0, seed: int = 0) -> list[torch.Tensor]:
    """Iterates ``[K_g+1, tokens, width]`` (float64) for each group in ``groups`` run ``steps`` loop
    steps (one count for all, or one per group), consecutive fixed points ``drift`` apart."""
    if width % 2:
        raise RdepthError(f"width must be even (rotations act on coordinate pairs), got {width}")
    counts = [steps] * len(groups) if isinstance(steps, int) else list(steps)
    generator = torch.Generator().manual_seed(seed)
    point = state_scale * torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    out = []
    for index, (group, count) in enumerate(zip(groups, counts, strict=False)):
        if index:
            direction = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
            point = point + drift * direction / direction.norm(dim=-1, keepdim=True)
        offset = group.noise * torch.randn(tokens, width, generator=generator, dtype=torch.float64) / math.sqrt(width)
        states = [point + offset]
        for _ in range(count):
            offset = group.contraction * _rotate(offset, group.rotation)
            states.append(point + offset)
        out.append(torch.stack(states))
    return out


def observe(observer, groups: list[torch.Tensor]) -> None:
    """Feed one batch of trajectories (``groups[g]`` ``[K_g+1, N, d]``) to ``observer`` as the model does:
    ``observer(group, step, state [1, N, d], None)`` for every group and step in order."""
    for group, states in enumerate(groups):
        for step, state in enumerate(states):
            observer(group, step, state.unsqueeze(0), None)


def dynamics_from_curves(step_sizes: list[float], cosines: list[float], floor: int | None) -> LoopDynamics | None:
    """A group's loop dynamics read off its saved mean curves, refinement steps only (k >= 1, above the noise
    floor ``floor``): contraction = median of ||Delta^(k+1)|| / ||Delta^(k)||, rotation = arccos of the median
    cosine, and a start noise that makes the model's ||Delta^(1)|| equal the run's. None when fewer than
    three refinement steps are above the floor."""
    end = len(step_sizes) if floor is None else min(floor, len(step_sizes))
    sizes = step_sizes[1:end]
    if len(sizes) < 3 or not all(size > 0 for size in sizes):
        return None
    ratios = sorted(b / a for a, b in zip(sizes, sizes[1:], strict=False))
    contraction = min(ratios[len(ratios) // 2], 1.0)
    turns = sorted(cosines[1:max(end - 1, 2)]) or [1.0]
    rotation = math.acos(max(-1.0, min(1.0, turns[len(turns) // 2])))
    # ||Delta^(1)|| = r |r e^{i theta} - 1| ||x^(0) - p|| in the linear loop
    gain = contraction * abs(complex(contraction * math.cos(rotation), contraction * math.sin(rotation)) - 1)
    return LoopDynamics(contraction, rotation, sizes[0] / gain if gain > 0 else 1.0)


def zero_drift_control(previous: LoopDynamics, following: LoopDynamics, steps: int, tokens: int = 256,
                       seed: int = 0) -> float:
    """Median hand-off ratio (:func:`rdepth.geometry.metrics.handoff_ratio`) of two loops with these
    dynamics run ``steps`` steps each, settling at the same point (zero drift): what the measure reads
    with no drift at all."""
    from rdepth.geometry.metrics import handoff_ratio

    first, second = trajectories([previous, following], steps, drift=0.0, tokens=tokens, seed=seed)
    return float(handoff_ratio(first, second).nanmedian())

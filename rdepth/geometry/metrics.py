"""Iterate-level loop geometry: plain tensor functions on a trajectory of states.

A looped group g runs K steps; its iterates for N tokens are a tensor
``states`` of shape [K+1, N, d]: ``states[0]`` is the initial (random) state
x^(0), ``states[k]`` the state after k loop steps. The update at step k is
Delta^(k) = x^(k+1) - x^(k) (the paper's Eq. 1), so there are K updates.

Every function here is pure (no model, no I/O) and works in float64
internally, so that the batch answers serve as the reference the streaming
observer (``rdepth.geometry.stream``) is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rdepth.errors import RdepthError

# Added to denominators of step-size ratios so that a zero state gives an infinite-free
# relative step and a zero mean step a finite DLR. Not used by the cosine (see :func:`cosine`).
EPS = 1e-12


def _check_states(states: torch.Tensor, min_steps: int = 1) -> None:
    if states.dim() != 3:
        raise RdepthError(f"states must have shape [K+1, N, d], got {tuple(states.shape)}")
    if states.shape[0] < min_steps + 1:
        raise RdepthError(
            f"states need at least {min_steps + 1} iterates for this metric, got {states.shape[0]}"
        )


def updates(states: torch.Tensor) -> torch.Tensor:
    """Loop updates Delta^(k) = x^(k+1) - x^(k): [K+1, N, d] -> [K, N, d] (float64)."""
    _check_states(states)
    states = states.double()
    return states[1:] - states[:-1]


def step_sizes(states: torch.Tensor) -> torch.Tensor:
    """Step size ||Delta^(k)||_2 per step and token: [K+1, N, d] -> [K, N]."""
    return updates(states).norm(dim=-1)


def relative_step_sizes(states: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Step size relative to the state it starts from, ||Delta^(k)|| / ||x^(k)||: -> [K, N].

    This is the paper's scale-free step norm (s~ in §4); it is what decides
    per-token convergence in :func:`convergence_steps`.
    """
    states = states.double()
    return step_sizes(states) / (states[:-1].norm(dim=-1) + eps)


def cosine(dots: torch.Tensor, norms_a: torch.Tensor, norms_b: torch.Tensor) -> torch.Tensor:
    """dots / (norms_a * norms_b), elementwise in float64, and 0 where a norm is exactly 0.

    The epsilon is relative, not additive: a fixed ``+1e-12`` in the denominator pulls the cosine of
    two steps of size 1e-6 toward 0 by a factor 1/(1 + 1e-12/1e-12) = 1/2, and its bias grows as the
    loop contracts. Here the only guard is against an exact zero (a step that did not move), so the
    cosine of any two non-zero steps is exact however small they are (their float rounding noise is
    the noise floor's business, :data:`rdepth.geometry.summary.NOISE_FLOOR`).
    """
    denominator = norms_a.double() * norms_b.double()
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator > 0, dots.double() / safe, torch.zeros_like(denominator))


def step_cosines(states: torch.Tensor) -> torch.Tensor:
    """Consecutive-step cosine cos(Delta^(j), Delta^(j+1)): [K+1, N, d] -> [K-1, N].

    Row j compares step j with step j+1 (the paper's cos(Delta^(k), Delta^(k-1))
    with k = j+1). A zero update gives cosine 0 (:func:`cosine`).
    """
    _check_states(states, min_steps=2)
    delta = updates(states)
    dots = (delta[1:] * delta[:-1]).sum(dim=-1)
    norms = delta.norm(dim=-1)
    return cosine(dots, norms[1:], norms[:-1])


def accelerations(states: torch.Tensor) -> torch.Tensor:
    """Second-order step ||Delta^(j+1) - Delta^(j)||_2 (the paper's Eq. 5): -> [K-1, N]."""
    _check_states(states, min_steps=2)
    delta = updates(states)
    return (delta[1:] - delta[:-1]).norm(dim=-1)


# ---------------------------------------------------------------------------
# Drift-to-Loop Ratio (Eq. 2) and its refinement-step variant
# ---------------------------------------------------------------------------

# A DLR definition is a numerator (which iterate of the next group is compared with
# the previous group's output) and a denominator (which of the previous group's
# steps make up its "loop step").
#
# Numerators: ||x_{g+1}^(i) - x_g^(K_g)||_2 with i from DLR_NUMERATORS. Step 0 is the
# paper-literal choice; since x^(0) is fresh noise, its distance to anything is large
# by construction, so the default ("first") uses the first computed iterate
# x_{g+1}^(1): the first state that depends on what group g handed on. "output"
# compares the two groups' outputs x_{g+1}^(K_{g+1}) - x_g^(K_g).
DLR_NUMERATORS: dict[str, Callable[[int], int]] = {
    "literal": lambda k_next: 0,
    "first": lambda k_next: 1,
    "output": lambda k_next: k_next,
}
# Denominators: the mean step size of group g over its steps k = start .. K_g - 1, with
# start from DLR_DENOMINATORS.
# * "all" (start 0): (1/K_g) sum_{k=0}^{K_g-1} ||Delta_g^(k)||, Eq. 2 as written. It includes
#   Delta_g^(0) = x_g^(1) - x_g^(0), the jump from the random initial state to the first
#   iterate, which is much larger than the refinement steps after it (the more so at
#   Geiping et al.'s initial-state scale), so the mean is ~||Delta^(0)|| / K_g and the
#   ratio grows roughly like K_g with the loop budget.
# * "refine" (start 1): (1/(K_g-1)) sum_{k=1}^{K_g-1} ||Delta_g^(k)||, the refinement steps
#   only. Undefined (NaN) when K_g = 1. It is still a mean over the loop's steps: when they
#   contract, it also shrinks as the budget grows, so compare either variant at equal budgets.
DLR_DENOMINATORS: dict[str, int] = {"all": 0, "refine": 1}
# Definition names: "<numerator>" with Eq. 2's denominator, "<numerator>_refine" with the
# refinement-step denominator. "literal" is Eq. 2 exactly as written.
DLR_DEFINITIONS: dict[str, tuple[str, str]] = {
    (numerator if denominator == "all" else f"{numerator}_{denominator}"): (numerator, denominator)
    for denominator in DLR_DENOMINATORS
    for numerator in DLR_NUMERATORS
}
DEFAULT_DLR = "first"


def dlr_parts(definition: str) -> tuple[str, str]:
    """(numerator, denominator) of a DLR definition name (RdepthError if unknown)."""
    if definition not in DLR_DEFINITIONS:
        raise RdepthError(
            f"unknown DLR definition {definition!r} (choose from {', '.join(DLR_DEFINITIONS)})"
        )
    return DLR_DEFINITIONS[definition]


def dlr_next_index(definition: str, k_next: int) -> int:
    """Index into the next group's iterates [0..K_{g+1}] used by a DLR definition's numerator."""
    numerator, _ = dlr_parts(definition)
    index = DLR_NUMERATORS[numerator](k_next)
    if index > k_next:
        raise RdepthError(f"DLR definition {definition!r} needs {index} steps, group ran {k_next}")
    return index


def mean_step_size(states: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Mean step size over steps k = start .. K-1, (1/(K-start)) sum_k ||Delta^(k)||_2: -> [N].

    ``states`` [K+1, N, d]. ``start`` 0 is Eq. 2's denominator (all K steps), 1 the
    refinement steps after the jump from x^(0). NaN for every token when K <= start.
    """
    sizes = step_sizes(states)
    if sizes.shape[0] <= start:
        return torch.full(sizes.shape[1:], float("nan"), dtype=torch.float64, device=sizes.device)
    return sizes[start:].mean(dim=0)


def drift_to_loop_ratio(
    prev_states: torch.Tensor,
    next_states: torch.Tensor,
    definition: str = DEFAULT_DLR,
    eps: float = EPS,
) -> torch.Tensor:
    """Drift-to-Loop Ratio at a boundary g -> g+1, per token: -> [N].

    ``prev_states`` [K_g+1, N, d] are group g's iterates, ``next_states``
    [K_{g+1}+1, N, d] group g+1's. ``definition`` (see ``DLR_DEFINITIONS``) picks

    * the numerator ||x_{g+1}^(i) - x_g^(K_g)||_2: i = 0 ("literal..."), 1 ("first...")
      or K_{g+1} ("output...");
    * the denominator, a mean step size of group g: over all steps
      k = 0..K_g-1 (no suffix, Eq. 2 as written, including the jump Delta^(0) from the
      random initial state), or over the refinement steps k = 1..K_g-1 only ("_refine";
      NaN when K_g = 1).

    ``"literal"`` is the paper's Eq. 2 exactly. Values above 1 mean the hand-off moves a
    token further than an average loop step.
    """
    _check_states(prev_states)
    if next_states.dim() != 3 or next_states.shape[1:] != prev_states.shape[1:]:
        raise RdepthError(
            f"next_states {tuple(next_states.shape)} do not match prev_states "
            f"{tuple(prev_states.shape)} in tokens and width"
        )
    _, denominator = dlr_parts(definition)
    index = dlr_next_index(definition, next_states.shape[0] - 1)
    drift = (next_states[index].double() - prev_states[-1].double()).norm(dim=-1)
    loop = mean_step_size(prev_states, DLR_DENOMINATORS[denominator])
    return drift / (loop + eps)


# ---------------------------------------------------------------------------
# Hand-off drift against the loop's extent: claim 3 by a measure free of K and of x^(0)
# ---------------------------------------------------------------------------

# Eq. 2 compares a distance with a *mean* step: on a contracting loop the mean over K steps falls
# like 1/K, so the ratio grows with the loop budget; and its numerator starts at x_{g+1}^(0), fresh
# noise, so it reads the noise scale, not drift. This measure uses only computed iterates (k >= 1)
# and two distances that stop changing once the loops have settled:
#
#   handoff_g = ||x_{g+1}^(K_{g+1}) - x_g^(K_g)||_2 / max_{1<=k<=K_g} ||x_g^(k) - x_g^(1)||_2
#
# The numerator is how far the representation moves from one group's hand-off state to the next's
# (where each loop settles); the denominator the extent of group g's refinement after its first
# computed iterate (the size of the "tight arc" of the paper's PCA figure; for a contraction it tends
# to ||x^(1) - x*||, for a spiral of constant radius to its diameter, for both independent of K once
# the loop has settled). When both groups settle at the same point (zero drift) the numerator is only
# what the next loop has left to contract, so the ratio tends to 0 as K grows.
HANDOFF = "handoff"


def loop_extent(states: torch.Tensor) -> torch.Tensor:
    """max_{1<=k<=K} ||x^(k) - x^(1)||_2 per token, the refinement's extent: [K+1, N, d] -> [N] (float64).

    Zero when K = 1 (one computed iterate, nothing refined).
    """
    _check_states(states)
    computed = states[1:].double()
    return (computed - computed[0]).norm(dim=-1).amax(dim=0)


def handoff_ratio(prev_states: torch.Tensor, next_states: torch.Tensor) -> torch.Tensor:
    """Hand-off drift over group g's refinement extent, per token (see ``HANDOFF``): -> [N].

    ``prev_states`` [K_g+1, N, d], ``next_states`` [K_{g+1}+1, N, d]. NaN where the extent is zero
    (K_g = 1, or a loop that did not move after its first iterate).
    """
    _check_states(prev_states)
    _check_states(next_states)
    if next_states.shape[1:] != prev_states.shape[1:]:
        raise RdepthError(f"next_states {tuple(next_states.shape)} do not match prev_states "
                          f"{tuple(prev_states.shape)} in tokens and width")
    drift = (next_states[-1].double() - prev_states[-1].double()).norm(dim=-1)
    extent = loop_extent(prev_states)
    return torch.where(extent > 0, drift / torch.where(extent > 0, extent, torch.ones_like(extent)),
                       torch.full_like(extent, float("nan")))


# ---------------------------------------------------------------------------
# Effective rank, PCA, convergence, summaries
# ---------------------------------------------------------------------------


def effective_rank_from_singular_values(singular_values: torch.Tensor, eps: float = EPS) -> float:
    """exp(entropy) of the normalised singular values p_i = s_i / sum_j s_j (Roy & Vetterli).

    Equals r for r equal non-zero singular values, 1 for a rank-1 matrix; 0 for
    an all-zero matrix (no update at all). Updates at float rounding level look
    isotropic, so late-step ranks of a converged loop approach d: read them
    together with the step sizes.
    """
    s = singular_values.double().clamp_min(0)
    total = s.sum()
    if total <= eps:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def effective_rank_from_gram(gram: torch.Tensor) -> float:
    """Effective rank of a matrix U [N, d] given its Gram matrix U^T U [d, d].

    The singular values of U are the square roots of the Gram eigenvalues, so
    the streaming observer can accumulate Gram matrices batch by batch.
    """
    eigenvalues = torch.linalg.eigvalsh(gram.double())
    return effective_rank_from_singular_values(eigenvalues.clamp_min(0).sqrt())


def effective_rank(matrix: torch.Tensor) -> float:
    """Effective rank of the rows of ``matrix`` [N, d] (uncentred: the updates as they are)."""
    if matrix.dim() != 2:
        raise RdepthError(f"effective_rank expects [N, d], got {tuple(matrix.shape)}")
    return effective_rank_from_singular_values(torch.linalg.svdvals(matrix.double()))


def update_effective_ranks(states: torch.Tensor) -> torch.Tensor:
    """Effective rank of the N updates at each loop step: [K+1, N, d] -> [K]."""
    return torch.tensor([effective_rank(delta) for delta in updates(states)], dtype=torch.float64)


@dataclass
class PCA2D:
    """A 2-D PCA fit: ``project(x)`` = (x - mean) @ components.T."""

    mean: torch.Tensor  # [d]
    components: torch.Tensor  # [2, d], orthonormal rows
    explained_variance_ratio: torch.Tensor  # [2]

    def project(self, points: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., 2]."""
        return (points.double() - self.mean) @ self.components.T


def pca_2d(points: torch.Tensor) -> PCA2D:
    """Fit 2-D PCA on ``points`` [M, d] (e.g. the union of all states of one sequence).

    Uses the eigenvectors of the covariance. Each component's sign is fixed so
    that its largest-magnitude entry is positive, making the fit deterministic.
    """
    if points.dim() != 2 or points.shape[0] < 2:
        raise RdepthError(f"pca_2d expects [M>=2, d] points, got {tuple(points.shape)}")
    points = points.double()
    mean = points.mean(dim=0)
    centred = points - mean
    covariance = centred.T @ centred / (points.shape[0] - 1)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
    order = torch.argsort(eigenvalues, descending=True)
    eigenvalues, eigenvectors = eigenvalues[order], eigenvectors[:, order]
    components = eigenvectors[:, :2].T.clone()
    if components.shape[0] < 2:  # d == 1: pad with a zero direction
        components = torch.cat([components, torch.zeros_like(components)])
    for row in components:
        if row[row.abs().argmax()] < 0:
            row.neg_()
    total = eigenvalues.clamp_min(0).sum()
    top = eigenvalues[:2].clamp_min(0)
    if top.numel() < 2:
        top = torch.cat([top, top.new_zeros(2 - top.numel())])
    ratio = top / total if total > 0 else torch.zeros(2, dtype=torch.float64)
    return PCA2D(mean=mean, components=components, explained_variance_ratio=ratio)


def convergence_steps(states: torch.Tensor, threshold: float) -> torch.Tensor:
    """First step k whose relative step size drops under ``threshold``: -> [N] long.

    A token that never drops under it gets K (the number of steps run), so the
    slowest tokens sort last; compare against K to tell "converged at the end"
    from "never converged" (see :func:`relative_step_sizes`).
    """
    return first_below(relative_step_sizes(states), threshold)


def first_below(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """Index of the first row of ``values`` [K, N] under ``threshold`` per column, else K."""
    below = values < threshold
    steps = torch.arange(values.shape[0], device=values.device).unsqueeze(1).expand_as(values)
    never = torch.full_like(steps, values.shape[0])
    return torch.where(below, steps, never).min(dim=0).values


def summarize(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and population standard deviation over tokens: [K, N] -> {"mean": [K], "std": [K]}."""
    values = values.double()
    return {"mean": values.mean(dim=-1), "std": values.std(dim=-1, correction=0)}

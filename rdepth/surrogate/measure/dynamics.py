"""Depth dynamics of a layer stack (teacher or surrogate).

All functions take stacked states (S, N, T, D) (S = L+1 depths) and a mask (N, T) and return
plain lists (one value per depth) so the caller can save them as JSON. "First" is the first
token (CLS for BERT and ViT); "others" are the remaining real tokens.
"""

from __future__ import annotations

import math

import torch

from rdepth.geometry.metrics import effective_rank, step_cosines, step_sizes


def _angle_degrees(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1.0, 1.0)
    return torch.rad2deg(torch.arccos(cos))


def _others_mask(mask: torch.Tensor) -> torch.Tensor:
    others = mask.clone()
    others[:, 0] = False
    return others


def angular_convergence(states: torch.Tensor, mask: torch.Tensor) -> dict[str, list[float]]:
    """Mean angle (degrees) each token turns per layer, and its angle to its final direction.

    ``step_first``/``step_others``: angle between depth d-1 and d, for d = 1..L;
    ``to_final_first``/``to_final_others``: angle between depth d and depth L, for d = 0..L.
    """
    others = _others_mask(mask)
    result: dict[str, list[float]] = {"step_first": [], "step_others": [], "to_final_first": [], "to_final_others": []}
    for d in range(states.shape[0]):
        result["to_final_first"].append(float(_angle_degrees(states[d][:, 0], states[-1][:, 0]).mean()))
        result["to_final_others"].append(float(_angle_degrees(states[d][others], states[-1][others]).mean())
                                         if others.any() else math.nan)
        if d == 0:
            continue
        result["step_first"].append(float(_angle_degrees(states[d][:, 0], states[d - 1][:, 0]).mean()))
        result["step_others"].append(float(_angle_degrees(states[d][others], states[d - 1][others]).mean())
                                     if others.any() else math.nan)
    return result


def mean_direction_coherence(states: torch.Tensor, mask: torch.Tensor) -> dict[str, list[float]]:
    """Per depth: how aligned tokens are with the mean direction of the non-first tokens.

    ``others``: mean cos(token, mean of the other tokens of its sequence) over non-first tokens;
    ``first``: mean cos(first token, that mean direction). One value per depth d = 0..L.
    """
    others = _others_mask(mask)
    weights = others.double()[:, :, None]  # (N, T, 1)
    has_others = others.any(1)
    result: dict[str, list[float]] = {"others": [], "first": []}
    for d in range(states.shape[0]):
        state = states[d].double()
        mean = (state * weights).sum(1) / weights.sum(1).clamp_min(1.0)  # (N, D)
        cos_tokens = torch.nn.functional.cosine_similarity(state, mean[:, None, :], dim=-1)  # (N, T)
        result["others"].append(float(cos_tokens[others].mean()) if others.any() else math.nan)
        cos_first = torch.nn.functional.cosine_similarity(state[:, 0], mean, dim=-1)
        result["first"].append(float(cos_first[has_others].mean()) if has_others.any() else math.nan)
    return result


def update_effective_rank(states: torch.Tensor, mask: torch.Tensor, max_tokens: int = 4096) -> list[float]:
    """Effective rank (:func:`rdepth.geometry.effective_rank`) of the per-depth updates
    h_d - h_{d-1} over real tokens, centred over tokens, d = 1..L."""
    updates = states[1:, mask] - states[:-1, mask]  # (L, N_tokens, D)
    if updates.shape[1] > max_tokens:
        updates = updates[:, torch.linspace(0, updates.shape[1] - 1, max_tokens).long()]
    return [effective_rank(u - u.mean(0)) for u in updates]


def phase_loop_geometry(states: torch.Tensor, mask: torch.Tensor, lengths: tuple[int, ...]) -> list[dict]:
    """Loop geometry of each phase, read as a loop (the surrogate's block iterated n times).

    Phase p covers depths a..a+n (a = sum of the earlier lengths); its n+1 states over real
    tokens are the iterates [n+1, N_tokens, D] that :func:`rdepth.geometry.step_sizes` and
    :func:`rdepth.geometry.step_cosines` take, exactly as ``rdepth analyze`` reads a loop group.
    Returns per phase the mean step size and mean consecutive-step cosine per step.
    """
    if sum(lengths) != states.shape[0] - 1:
        raise ValueError(f"phase lengths {lengths} do not cover {states.shape[0] - 1} layers")
    result, start = [], 0
    for phase, length in enumerate(lengths):
        iterates = states[start:start + length + 1][:, mask].double()  # (n+1, N_tokens, D)
        sizes = step_sizes(iterates)
        cosines = step_cosines(iterates) if length >= 2 else torch.zeros(0, iterates.shape[1])
        result.append({"phase": phase, "layers": [start, start + length - 1],
                       "step_size": [float(v) for v in sizes.mean(1)],
                       "cosine": [float(v) for v in cosines.mean(1)]})
        start += length
    return result


def dynamics_summary(states: torch.Tensor, mask: torch.Tensor, lengths: tuple[int, ...] | None = None) -> dict:
    """All analyses of one stack of states; with phase ``lengths`` also the per-phase loop geometry."""
    summary = {"angular": angular_convergence(states, mask), "coherence": mean_direction_coherence(states, mask),
               "update_effective_rank": update_effective_rank(states, mask)}
    if lengths is not None:
        summary["loop_geometry"] = phase_loop_geometry(states, mask, lengths)
    return summary

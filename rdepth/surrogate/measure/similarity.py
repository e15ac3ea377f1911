"""Between-layer representational similarity matrices.

Every function takes ``states``: (S, B, T, D) stacked layer states (S = number of depths)
and ``mask``: (B, T) bool (True on real tokens), and returns an (S, S) float64 matrix.
The measures are chosen by name from :data:`SIMILARITIES`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rdepth.errors import RdepthError


def _pool(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(states.dtype)[None, :, :, None]  # (1, B, T, 1)
    return (states * weights).sum(2) / weights.sum(2).clamp_min(1.0)  # (S, B, D)


def pooled_cosine(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S[i, j] = mean over sequences of cos(mean-pooled state i, mean-pooled state j)."""
    pooled = torch.nn.functional.normalize(_pool(states, mask).double(), dim=-1)  # (S, B, D)
    return torch.einsum("ibd,jbd->ij", pooled, pooled) / pooled.shape[1]


def token_cosine(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S[i, j] = mean over real tokens of cos(state i of the token, state j of the same token)."""
    tokens = torch.nn.functional.normalize(states[:, mask].double(), dim=-1)  # (S, N, D)
    return torch.einsum("ind,jnd->ij", tokens, tokens) / tokens.shape[1]


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Linear centred kernel alignment of x (N, D1) and y (N, D2), rows = the same examples.

    CKA = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F); 1 for x == y, invariant to
    orthogonal transforms and isotropic scaling of either argument.
    """
    if x.shape[0] != y.shape[0]:
        raise RdepthError(f"linear_cka: {x.shape[0]} rows against {y.shape[0]}")
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    cross = (y.T @ x).square().sum()
    return cross / ((x.T @ x).norm() * (y.T @ y).norm()).clamp_min(1e-300)


def cka(states: torch.Tensor, mask: torch.Tensor, max_tokens: int = 4096) -> torch.Tensor:
    """S[i, j] = linear CKA over real tokens (the first ``max_tokens``, spread evenly)."""
    tokens = states[:, mask]  # (S, N, D)
    if tokens.shape[1] > max_tokens:
        index = torch.linspace(0, tokens.shape[1] - 1, max_tokens).long()
        tokens = tokens[:, index]
    depth = tokens.shape[0]
    matrix = torch.ones(depth, depth, dtype=torch.float64)
    for i in range(depth):
        for j in range(i + 1, depth):
            matrix[i, j] = matrix[j, i] = linear_cka(tokens[i], tokens[j])
    return matrix


SIMILARITIES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "pooled_cosine": pooled_cosine,
    "token_cosine": token_cosine,
    "cka": cka,
}


def similarity_matrices(states: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every measure of :data:`SIMILARITIES` on the same states: name -> (S, S)."""
    return {name: fn(states, mask) for name, fn in SIMILARITIES.items()}

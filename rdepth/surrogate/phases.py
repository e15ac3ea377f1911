"""Contiguous phases of a layer-similarity matrix.

A segmentation of L layers into k phases is given by its phase lengths (n_1, ..., n_k),
all >= 1, summing to L. Phase p covers layers [start_p, start_p + n_p).

Objective (to maximise) of :func:`dp_phases`: the average association
    J = sum_p (1 / n_p) * sum_{i, j in phase p} S[i, j],
i.e. every phase contributes its size times its mean within-phase similarity. For a constant
matrix every segmentation scores the same; for a block matrix the blocks win. J is additive
over phases, so an O(k L^2) dynamic programme finds the exact optimum.

:func:`max_cut_phases` follows the paper's reference implementation instead: recursive
bisection by maximum cut of the dissimilarity graph W = 1 - S, here restricted to contiguous
cuts: split the phase whose best cut removes the most weight, until k phases remain.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from rdepth.errors import RdepthError


def _check(similarity: torch.Tensor, k: int) -> int:
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise RdepthError(f"similarity matrix must be square, got shape {tuple(similarity.shape)}")
    n_layers = similarity.shape[0]
    if not 1 <= k <= n_layers:
        raise RdepthError(f"k must be between 1 and the number of layers ({n_layers}), got {k}")
    return n_layers


def phase_starts(lengths: tuple[int, ...]) -> list[int]:
    starts, position = [], 0
    for length in lengths:
        starts.append(position)
        position += length
    return starts


def segmentation_score(similarity: torch.Tensor, lengths: tuple[int, ...]) -> float:
    """The average-association objective J of a segmentation (see module docstring)."""
    score = 0.0
    for start, length in zip(phase_starts(lengths), lengths, strict=False):
        score += float(similarity[start:start + length, start:start + length].sum()) / length
    return score


def dp_phases(similarity: torch.Tensor, k: int) -> tuple[int, ...]:
    """Exact maximiser of J over all contiguous k-phase segmentations. Ties: earliest cuts."""
    n_layers = _check(similarity, k)
    s = similarity.double()
    # block[a][b] = J contribution of one phase covering layers [a, b)
    prefix = torch.zeros(n_layers + 1, n_layers + 1, dtype=torch.float64)
    prefix[1:, 1:] = s.cumsum(0).cumsum(1)

    def block(a: int, b: int) -> float:
        total = prefix[b, b] - prefix[a, b] - prefix[b, a] + prefix[a, a]
        return float(total) / (b - a)

    neg = float("-inf")
    best = [[neg] * (n_layers + 1) for _ in range(k + 1)]  # best[p][b]: p phases covering [0, b)
    choice = [[0] * (n_layers + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for p in range(1, k + 1):
        for b in range(p, n_layers + 1):
            for a in range(p - 1, b):
                if best[p - 1][a] == neg:
                    continue
                value = best[p - 1][a] + block(a, b)
                if value > best[p][b] + 1e-12:
                    best[p][b], choice[p][b] = value, a
    lengths, b = [], n_layers
    for p in range(k, 0, -1):
        a = choice[p][b]
        lengths.append(b - a)
        b = a
    return tuple(reversed(lengths))


def all_segmentations(n_layers: int, k: int) -> list[tuple[int, ...]]:
    """Every contiguous segmentation of n_layers into k non-empty phases (lengths)."""
    result = []
    for cuts in itertools.combinations(range(1, n_layers), k - 1):
        bounds = (0, *cuts, n_layers)
        result.append(tuple(bounds[i + 1] - bounds[i] for i in range(k)))
    return result


def brute_force_phases(similarity: torch.Tensor, k: int) -> tuple[tuple[int, ...], float]:
    """Best segmentation by enumeration (for tests): (lengths, score)."""
    n_layers = _check(similarity, k)
    scored = [(segmentation_score(similarity, lengths), lengths) for lengths in all_segmentations(n_layers, k)]
    score, lengths = max(scored, key=lambda item: item[0])
    return lengths, score


def _cut_weight(weights: torch.Tensor, a: int, c: int, b: int) -> float:
    """Total weight of edges between layers [a, c) and [c, b)."""
    return float(weights[a:c, c:b].sum())


def max_cut_phases(similarity: torch.Tensor, k: int) -> tuple[int, ...]:
    """Recursive contiguous max-cut bisection of W = 1 - S into k phases (lengths)."""
    n_layers = _check(similarity, k)
    weights = 1.0 - similarity.double()
    segments = [(0, n_layers)]
    while len(segments) < k:
        best = None  # (cut weight, segment index, cut position)
        for index, (a, b) in enumerate(segments):
            for c in range(a + 1, b):
                weight = _cut_weight(weights, a, c, b)
                if best is None or weight > best[0] + 1e-12:
                    best = (weight, index, c)
        _, index, c = best
        a, b = segments[index]
        segments[index: index + 1] = [(a, c), (c, b)]
    return tuple(b - a for a, b in segments)


def equal_phases(n_layers: int, k: int) -> tuple[int, ...]:
    """Phases that ignore the matrix: as equal as possible, longer ones first."""
    if not 1 <= k <= n_layers:
        raise RdepthError(f"k must be between 1 and the number of layers ({n_layers}), got {k}")
    base, extra = divmod(n_layers, k)
    return tuple(base + (1 if p < extra else 0) for p in range(k))


PHASE_METHODS: dict[str, Callable[[torch.Tensor, int], tuple[int, ...]]] = {
    "dp": dp_phases,
    "maxcut": max_cut_phases,
}


def block_structure(similarity: torch.Tensor, lengths: tuple[int, ...]) -> dict[str, float]:
    """How block-structured S is under a segmentation (diagonal excluded).

    * ``within``: mean S over pairs of distinct layers in the same phase;
    * ``between``: mean S over pairs in different phases (nan for k = 1);
    * ``contrast``: within - between;
    * ``variance_explained``: 1 - SSE/SST of the piecewise-constant model that replaces each
      (phase x phase) block of the off-diagonal entries by its mean.
    """
    n_layers = similarity.shape[0]
    s = similarity.double()
    label = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    off_diagonal = ~torch.eye(n_layers, dtype=torch.bool)
    same = (label[:, None] == label[None, :]) & off_diagonal
    different = label[:, None] != label[None, :]
    within = float(s[same].mean()) if same.any() else float("nan")
    between = float(s[different].mean()) if different.any() else float("nan")
    fitted = torch.zeros_like(s)
    for p in range(len(lengths)):
        for q in range(len(lengths)):
            cell = (label[:, None] == p) & (label[None, :] == q) & off_diagonal
            if cell.any():
                fitted[cell] = s[cell].mean()
    values = s[off_diagonal]
    sst = float((values - values.mean()).square().sum())
    sse = float((values - fitted[off_diagonal]).square().sum())
    return {"within": within, "between": between, "contrast": within - between,
            "variance_explained": 1.0 - sse / sst if sst > 0 else float("nan")}

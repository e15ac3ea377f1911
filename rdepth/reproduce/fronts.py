"""Exit rules compared along their quality-versus-cost fronts (issue 40, item 4). Pure functions, torch-free.

A rule swept over a threshold grid gives one (cost, quality) point per threshold: cost is what a token
pays (executed loop steps, or decode ms per token), quality is what it keeps (the negative perplexity
rise over the full budget: 0 is the full budget's quality, higher is better). Comparing two rules at
the same threshold compares nothing, since a threshold means something else to each rule; comparing their
fronts does. :func:`front` keeps the points no other point beats on both; rule A is better than rule B
when A's front dominates B's (:func:`dominates`): every point of B's front is matched by a point of A's
at no more cost and no less quality (within the slacks), and A has a point B's front cannot match.
:func:`neighbour_spread` is the stability of a rule: how far quality moves between neighbouring
thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Point = tuple[float, float]  # (cost, quality): lower cost and higher quality are better


def front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both axes (at most the cost and at least the quality, better on
    one), sorted by cost; duplicates kept once. A point with a non-finite cost or quality (a setting that
    diverged) is no point of a front (NaN would also make the order depend on the run: it hashes by
    identity)."""
    unique = sorted(set((float(c), float(q)) for c, q in points if math.isfinite(float(c)) and math.isfinite(float(q))))
    kept = []
    for cost, quality in unique:
        beaten = any(c <= cost and q >= quality and (c, q) != (cost, quality) for c, q in unique)
        if not beaten:
            kept.append((cost, quality))
    return kept


def matched(point: Point, others: Sequence[Point], cost_slack: float, quality_slack: float) -> bool:
    """Some point of ``others`` costs at most ``point``'s cost x (1 + cost_slack) and keeps at least its
    quality - quality_slack."""
    cost, quality = point
    return any(c <= cost * (1.0 + cost_slack) and q >= quality - quality_slack for c, q in others)


def dominates(a: Sequence[Point], b: Sequence[Point], cost_slack: float = 0.0,
              quality_slack: float = 0.0) -> dict[str, Any]:
    """Does the front of ``a`` dominate the front of ``b``?

    ``covers``: every point of b's front is matched by a's (:func:`matched`); ``better_at``: the points of
    a's front that b's front cannot match; ``dominates``: covers and better somewhere. Two fronts that cross
    (each better somewhere) dominate neither way; equal fronts neither either.
    """
    front_a, front_b = front(a), front(b)
    unmatched = [point for point in front_b if not matched(point, front_a, cost_slack, quality_slack)]
    better_at = [point for point in front_a if not matched(point, front_b, cost_slack, quality_slack)]
    return {"dominates": bool(front_a) and not unmatched and bool(better_at), "covers": not unmatched,
            "unmatched": unmatched, "better_at": better_at, "front": front_a, "other_front": front_b}


def neighbour_spread(qualities: Sequence[float]) -> float | None:
    """The largest quality change between neighbouring thresholds (``qualities`` in threshold order); None
    with fewer than two. A rule whose quality jumps between neighbours is one whose threshold is hard to set."""
    if len(qualities) < 2:
        return None
    return max(abs(b - a) for a, b in zip(qualities, qualities[1:], strict=False))


def cost_at(front_points: Sequence[Point], quality: float) -> float | None:
    """The cost a front needs to keep ``quality``: linear between its neighbouring points (a front is sorted by
    cost, its quality rising with it); None outside the front's quality range."""
    points = front(front_points)
    if not points or not points[0][1] <= quality <= points[-1][1]:
        return None
    for (c0, q0), (c1, q1) in zip(points, points[1:], strict=False):
        if q0 <= quality <= q1:
            return c0 if q1 == q0 else c0 + (quality - q0) / (q1 - q0) * (c1 - c0)
    return points[0][0]


def at_matched_quality(a: Sequence[Point], b: Sequence[Point], cost_slack: float = 0.0,
                       min_saving: float = 0.0) -> dict[str, Any]:
    """Front ``a`` against front ``b`` at equal quality, over the quality range both reach.

    ``shared``: [low, high], the overlap of the two fronts' quality ranges (None when they do not overlap);
    points outside it decide nothing. ``levels``: per quality level in it (every point of either front there),
    (quality, a's cost, b's cost) with costs interpolated along each front (:func:`cost_at`). ``cheaper``: a
    costs at most b's cost x (1 + cost_slack) at every level and at least ``min_saving`` less somewhere;
    ``costlier``: the same with a and b swapped; ``saving``: the largest share of b's cost that a saves.
    """
    front_a, front_b = front(a), front(b)
    if not front_a or not front_b:
        return {"shared": None, "levels": [], "cheaper": False, "costlier": False, "saving": None}
    low, high = max(front_a[0][1], front_b[0][1]), min(front_a[-1][1], front_b[-1][1])
    if low > high:
        return {"shared": None, "levels": [], "cheaper": False, "costlier": False, "saving": None}
    qualities = sorted({q for _, q in front_a + front_b if low <= q <= high})
    levels = [(q, cost_at(front_a, q), cost_at(front_b, q)) for q in qualities]
    savings = [1.0 - ca / cb if cb > 0 else 0.0 for _, ca, cb in levels]
    extra = [1.0 - cb / ca if ca > 0 else 0.0 for _, ca, cb in levels]
    return {"shared": [low, high], "levels": levels, "saving": max(savings),
            "cheaper": all(ca <= cb * (1.0 + cost_slack) for _, ca, cb in levels) and max(savings) >= min_saving,
            "costlier": all(cb <= ca * (1.0 + cost_slack) for _, ca, cb in levels) and max(extra) >= min_saving}


def largest_jump_from_flat(rises: Sequence[float], flat: float) -> float | None:
    """Stability on a threshold grid: the largest perplexity rise from one threshold to the next, over the
    thresholds whose own rise is at most ``flat`` (``rises`` in threshold order: a setting one would keep);
    0.0 when no such step exists beyond the last flat one, None with fewer than two thresholds."""
    if len(rises) < 2:
        return None
    jumps = [b - a for a, b in zip(rises, rises[1:], strict=False) if a <= flat]
    return max(jumps, default=0.0)

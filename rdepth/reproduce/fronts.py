"""Exit rules compared along their quality-versus-cost fronts (issue 40, item 4). Pure functions, torch-free.

A rule swept over a threshold grid gives one (cost, quality) point per threshold: cost is what a token
pays (executed loop steps, or decode ms per token), quality is what it keeps (the negative perplexity
rise over the full budget: 0 is the full budget's quality, higher is better). Comparing two rules at
the same threshold compares nothing, since a threshold means something else to each rule; comparing their
fronts does. :func:`front` keeps the points no other point beats on both; rule A is better than rule B
when A's front dominates B's (:func:`dominates`): every point of B's front is matched by a point of A's
at no more cost and no less quality (within the slacks), and A has a point B's front cannot match.
:func:`at_matched_quality` compares two fronts where both reach, at equal quality within a slack;
:func:`largest_rise` is the stability of a rule (the largest perplexity rise between neighbouring
thresholds, a diverged threshold unstable) and :func:`neighbour_spread` how far quality moves between
neighbouring thresholds either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Point = tuple[float, float]  # (cost, quality): lower cost and higher quality are better
# Comparisons of a saving against its bar allow this much (5% of 20 steps is 1 - 19/20 = 0.050000000000000044).
TOLERANCE = 1e-9


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


def cost_within(front_points: Sequence[Point], quality: float, quality_slack: float) -> float | None:
    """The least a front pays to keep at least ``quality - quality_slack`` (:func:`cost_at` there; its cheapest
    point when that point already keeps it); None when the front never reaches it, or when ``quality`` lies
    more than the slack below the front's lowest quality (what the rule would pay there was not measured)."""
    points = front(front_points)
    if not points:
        return None
    low, high = points[0][1], points[-1][1]
    if quality < low - quality_slack or quality - quality_slack > high:
        return None
    return cost_at(points, max(quality - quality_slack, low))


def _savings(mine: list[Point], theirs: list[Point], quality_slack: float) -> list[tuple[float, float, float]]:
    """Per point of ``mine`` that ``theirs`` can be held to: (quality, its cost, the least ``theirs`` pays to keep
    that quality within the slack)."""
    rows = []
    for cost, quality in mine:
        other = cost_within(theirs, quality, quality_slack)
        if other is not None:
            rows.append((quality, cost, other))
    return rows


def _saving(cost: float, other: float) -> float:
    return 1.0 - cost / other if other > 0 else 0.0


def at_matched_quality(a: Sequence[Point], b: Sequence[Point], cost_slack: float = 0.0,
                       min_saving: float = 0.0, quality_slack: float = 0.0) -> dict[str, Any]:
    """Front ``a`` against front ``b`` at equal quality, where equal means within ``quality_slack`` (the noise of
    one held-out set: on a flat front a quality difference inside it moves the cost a lot and means nothing).

    Cheaper is decided with the slack on the side that makes it hard to claim: a is ``cheaper`` when (i) every
    point of b's front that a reaches within the slack is matched by a point of a's costing at most its cost x
    (1 + cost_slack) and keeping its quality less the slack (a is dearer nowhere, the slack going a's way), and
    (ii) some point of a's front costs at least ``min_saving`` less than the least b pays to keep that point's
    quality less the slack (a saves even with the slack going b's way). Points more than the slack below the
    other front's lowest quality decide nothing (what the other rule pays there was not measured).
    ``costlier``: the same with a and b swapped. ``shared``: [low, high], the overlap of the two fronts' quality
    ranges (None when they are more than the slack apart); ``levels``: per point of a's front held to b's
    (quality, a's cost, the least b pays within the slack); ``saving``: the largest share of b's cost a saves
    there; ``unmatched``: b's points that a does not match.
    """
    front_a, front_b = front(a), front(b)
    empty = {"shared": None, "levels": [], "cheaper": False, "costlier": False, "saving": None, "unmatched": [],
             "quality_slack": quality_slack}
    if not front_a or not front_b:
        return empty
    low, high = max(front_a[0][1], front_b[0][1]), min(front_a[-1][1], front_b[-1][1])
    if low > high + quality_slack:
        return empty
    levels = _savings(front_a, front_b, quality_slack)
    others = _savings(front_b, front_a, quality_slack)
    if not levels or not others:
        return empty
    savings = [_saving(ca, cb) for _, ca, cb in levels]
    extra = [_saving(cb, ca) for _, cb, ca in others]
    unmatched = [(q, cb) for q, cb, ca in others if ca > cb * (1.0 + cost_slack)]
    unmatched_a = [(q, ca) for q, ca, cb in levels if cb > ca * (1.0 + cost_slack)]
    return {"shared": [min(low, high), max(low, high)], "levels": levels, "saving": max(savings), "unmatched": unmatched,
            "quality_slack": quality_slack,
            "cheaper": not unmatched and max(savings) >= min_saving - TOLERANCE,
            "costlier": not unmatched_a and max(extra) >= min_saving - TOLERANCE}


def largest_rise(rises: Sequence[float]) -> float | None:
    """Stability on a threshold grid: the largest perplexity rise from one threshold to the next, over every
    neighbouring pair (``rises`` in threshold order): a cliff after a threshold just outside the tolerance is
    still a cliff. A threshold whose perplexity is not finite (the setting diverged) makes it inf. None with
    fewer than two thresholds."""
    if len(rises) < 2:
        return None
    if not all(math.isfinite(float(rise)) for rise in rises):
        return math.inf
    return max(b - a for a, b in zip(rises, rises[1:], strict=False))

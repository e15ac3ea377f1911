"""Quality-versus-cost fronts (rdepth.reproduce.fronts) on points with known answers."""

from __future__ import annotations

import pytest

from rdepth.reproduce.fronts import dominates, front, matched, neighbour_spread


def test_the_front_keeps_what_nothing_beats():
    points = [(10, -0.0), (8, -0.01), (8, -0.02), (9, -0.03), (5, -0.1), (5, -0.1), (12, 0.0)]
    # (8, -0.02) and (9, -0.03) lose to (8, -0.01); (12, 0) to (10, 0); the duplicate is kept once
    assert front(points) == [(5, -0.1), (8, -0.01), (10, 0.0)]
    assert front([]) == []


def test_a_front_below_and_left_dominates():
    b = [(10, 0.0), (8, -0.02), (6, -0.1)]
    a = [(10, 0.0), (7, -0.01), (5, -0.05)]  # at every cost of b, a keeps more quality
    result = dominates(a, b)
    assert result["dominates"] and result["covers"] and result["unmatched"] == []
    assert result["better_at"] == [(5, -0.05), (7, -0.01)]
    assert not dominates(b, a)["dominates"] and not dominates(b, a)["covers"]


def test_equal_and_crossing_fronts_dominate_neither_way():
    b = [(10, 0.0), (8, -0.02), (6, -0.1)]
    assert not dominates(b, list(b))["dominates"] and dominates(b, list(b))["covers"]  # better nowhere
    cheap_lossy = [(10, 0.0), (4, -0.2)]  # cheaper than anything of b, at a loss b never takes
    careful = [(10, 0.0), (9, -0.001)]
    one, other = dominates(cheap_lossy, careful), dominates(careful, cheap_lossy)
    assert not one["dominates"] and not other["dominates"]
    assert one["unmatched"] == [(9, -0.001)] and other["unmatched"] == [(4, -0.2)]


def test_slack_forgives_differences_within_the_noise():
    b = [(10, 0.0), (8, -0.010)]
    a = [(10, 0.0), (8.05, -0.011), (6, -0.011)]  # 0.6% more cost and 0.1% less quality at b's knee
    assert not dominates(a, b)["dominates"]
    loose = dominates(a, b, cost_slack=0.01, quality_slack=0.002)
    assert loose["dominates"] and loose["better_at"] == [(6, -0.011)]
    assert matched((8, -0.01), [(8.05, -0.011)], 0.01, 0.002) and not matched((8, -0.01), [(8.2, -0.01)], 0.01, 0.0)


def test_neighbour_spread_is_the_largest_jump():
    assert neighbour_spread([0.0, -0.001, -0.003, -0.3]) == pytest.approx(0.297)
    assert neighbour_spread([0.1]) is None


def test_a_diverged_point_is_no_point_of_the_front_and_the_order_is_fixed():
    """A NaN or infinite cost or quality (a setting whose perplexity diverged) drops out: the front of the
    finite points, the same at every call (NaN hashes by identity: it made the order vary by run)."""
    finite = [(1.0, -0.5), (2.0, -0.1), (3.0, -0.2)]
    nan = float("nan")
    for _ in range(5):
        assert front(finite + [(1.5, nan), (nan, 0.0), (0.5, float("-inf"))]) == [(1.0, -0.5), (2.0, -0.1)]

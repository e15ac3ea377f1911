"""Loop-geometry metrics on constructed trajectories with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.geometry import (
    DLR_DEFINITIONS,
    accelerations,
    convergence_steps,
    drift_to_loop_ratio,
    effective_rank,
    effective_rank_from_gram,
    mean_step_size,
    pca_2d,
    relative_step_sizes,
    step_cosines,
    step_sizes,
    summarize,
    update_effective_ranks,
)


def _plane(d: int, seed: int = 0) -> torch.Tensor:
    """Two orthonormal directions in R^d: [2, d]."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, 2, generator=generator, dtype=torch.float64))
    return q.T


def _spiral(steps: int, tokens: int, d: int, radius: float, angle: float) -> torch.Tensor:
    """Points on a circle, one turn of ``angle`` per step, each token with its own plane/offset."""
    out = torch.empty(steps + 1, tokens, d, dtype=torch.float64)
    k = torch.arange(steps + 1, dtype=torch.float64)
    for token in range(tokens):
        basis = _plane(d, seed=token)
        offset = torch.randn(d, generator=torch.Generator().manual_seed(100 + token), dtype=torch.float64)
        coords = radius * torch.stack([torch.cos(k * angle), torch.sin(k * angle)], dim=1)
        out[:, token] = coords @ basis + offset
    return out


def test_spiral_constant_step_and_turning_angle():
    radius, angle = 2.0, 0.7
    states = _spiral(steps=12, tokens=3, d=16, radius=radius, angle=angle)
    sizes = step_sizes(states)
    assert sizes.shape == (12, 3)
    torch.testing.assert_close(sizes, torch.full_like(sizes, 2 * radius * math.sin(angle / 2)))
    cosines = step_cosines(states)
    assert cosines.shape == (11, 3)
    torch.testing.assert_close(cosines, torch.full_like(cosines, math.cos(angle)))
    # consecutive chords differ by a rotation of the same angle: constant acceleration
    chord = 2 * radius * math.sin(angle / 2)
    accel = accelerations(states)
    torch.testing.assert_close(accel, torch.full_like(accel, 2 * chord * math.sin(angle / 2)))


def test_geometric_contraction_shrinks_by_ratio():
    ratio = 0.6
    x0 = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    states = torch.stack([ratio**k * x0 for k in range(9)])
    sizes = step_sizes(states)
    torch.testing.assert_close(sizes[1:] / sizes[:-1], torch.full((7, 5), ratio, dtype=torch.float64))
    torch.testing.assert_close(sizes[0], (1 - ratio) * x0.norm(dim=-1))
    torch.testing.assert_close(step_cosines(states), torch.ones(7, 5, dtype=torch.float64))
    # ||Delta^(k)|| / ||x^(k)|| = (1 - a) for every step
    torch.testing.assert_close(relative_step_sizes(states), torch.full((8, 5), 1 - ratio, dtype=torch.float64))


def test_straight_line_constant_velocity():
    start = torch.randn(4, 6, dtype=torch.float64)
    velocity = torch.randn(4, 6, dtype=torch.float64)
    states = torch.stack([start + k * velocity for k in range(7)]).float()
    torch.testing.assert_close(step_sizes(states), velocity.norm(dim=-1).expand(6, 4), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_cosines(states), torch.ones(5, 4, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(accelerations(states), torch.zeros(5, 4, dtype=torch.float64), rtol=0, atol=1e-5)


def test_cosine_of_a_reversal_and_a_zero_step():
    # steps: +e1, -e1 (cosine -1), then zero (cosine 0 by convention, no NaN)
    e1 = torch.tensor([1.0, 0.0])
    states = torch.stack([torch.zeros(2), e1, torch.zeros(2), torch.zeros(2)]).unsqueeze(1)
    cosines = step_cosines(states)[:, 0]
    assert cosines[0] == pytest.approx(-1.0)
    assert cosines[1] == 0.0


def test_drift_to_loop_ratio_on_constructed_numbers():
    e1, e2, e3 = torch.eye(3, dtype=torch.float64)
    # group g: two steps of length 1 and 3 along e1 -> mean step 2; output x_g^(K) = 4 e1
    prev = torch.stack([torch.zeros(3), e1, 4 * e1]).unsqueeze(1)
    # group g+1: x^(0) = noise at 10 e2, x^(1) = 4 e1 + 6 e3, x^(2) = 4 e1 + 6 e3 + e2
    nxt = torch.stack([10 * e2, 4 * e1 + 6 * e3, 4 * e1 + 6 * e3 + e2]).unsqueeze(1)
    literal = drift_to_loop_ratio(prev, nxt, definition="literal")
    first = drift_to_loop_ratio(prev, nxt, definition="first")
    output = drift_to_loop_ratio(prev, nxt, definition="output")
    assert literal.shape == (1,)
    assert literal.item() == pytest.approx(math.sqrt(16 + 100) / 2)
    assert first.item() == pytest.approx(6 / 2)
    assert output.item() == pytest.approx(math.sqrt(36 + 1) / 2)
    # the refinement-step denominator leaves out step 0 (length 1): mean of {3} = 3
    assert drift_to_loop_ratio(prev, nxt, definition="first_refine").item() == pytest.approx(6 / 3)
    assert drift_to_loop_ratio(prev, nxt, definition="literal_refine").item() == pytest.approx(math.sqrt(116) / 3)
    assert drift_to_loop_ratio(prev, nxt, definition="output_refine").item() == pytest.approx(math.sqrt(37) / 3)
    with pytest.raises(RdepthError, match="unknown DLR definition"):
        drift_to_loop_ratio(prev, nxt, definition="nope")
    with pytest.raises(RdepthError, match="do not match"):
        drift_to_loop_ratio(prev, nxt[:, :, :2])


def test_dlr_denominators_differ_when_the_first_step_is_a_jump_from_noise():
    """Eq. 2's mean over all steps is dominated by the jump from x^(0); the k >= 1 mean is not."""
    e1, e2, e3 = torch.eye(3, dtype=torch.float64)
    # group g: x^(0) = 20 e2 (noise), then 0, e1, e1 + e3: steps 20, 1, 1 -> mean 22/3 over all, 1 over k >= 1
    prev = torch.stack([20 * e2, torch.zeros(3), e1, e1 + e3]).unsqueeze(1)
    # group g+1: x^(0) = 5 e2 (noise), x^(1) = 3 e1 + e3 (2 from the hand-off), x^(2) = 3 e1 + e2 + e3
    nxt = torch.stack([5 * e2, 3 * e1 + e3, 3 * e1 + e2 + e3]).unsqueeze(1)
    assert mean_step_size(prev).item() == pytest.approx(22 / 3)
    assert mean_step_size(prev, start=1).item() == pytest.approx(1.0)
    assert drift_to_loop_ratio(prev, nxt, "first").item() == pytest.approx(2 / (22 / 3))  # 0.27: "no drift"
    assert drift_to_loop_ratio(prev, nxt, "first_refine").item() == pytest.approx(2.0)  # 7.3x larger
    assert drift_to_loop_ratio(prev, nxt, "literal").item() == pytest.approx(math.sqrt(27) * 3 / 22)  # Eq. 2
    assert drift_to_loop_ratio(prev, nxt, "literal_refine").item() == pytest.approx(math.sqrt(27))
    assert drift_to_loop_ratio(prev, nxt, "output").item() == pytest.approx(math.sqrt(5) * 3 / 22)
    assert drift_to_loop_ratio(prev, nxt, "output_refine").item() == pytest.approx(math.sqrt(5))
    # the same hand-off after a longer loop of unit refinement steps: Eq. 2's ratio grows with K, k >= 1's does not
    longer = torch.cat([prev, (e1 + e3 + torch.arange(1, 9, dtype=torch.float64)[:, None] * e1).unsqueeze(1)])
    shifted = nxt + 8 * e1  # the same drift from the new output
    assert drift_to_loop_ratio(longer, shifted, "first").item() == pytest.approx(2 / (30 / 11))
    assert drift_to_loop_ratio(longer, shifted, "first_refine").item() == pytest.approx(2.0)
    # one step: no refinement step, NaN (not an error: the observer meets one-step groups)
    assert math.isnan(drift_to_loop_ratio(prev[:2], nxt, "first_refine").item())
    assert drift_to_loop_ratio(prev[:2], nxt, "first").item() == pytest.approx(math.sqrt(9 + 1) / 20)
    assert set(DLR_DEFINITIONS) == {"literal", "first", "output", "literal_refine", "first_refine", "output_refine"}
    assert DLR_DEFINITIONS["literal"] == ("literal", "all") and DLR_DEFINITIONS["first_refine"] == ("first", "refine")


def test_effective_rank_rank_one_and_isotropic():
    generator = torch.Generator().manual_seed(3)
    u = torch.randn(50, 1, generator=generator, dtype=torch.float64)
    v = torch.randn(1, 12, generator=generator, dtype=torch.float64)
    assert effective_rank(u @ v) == pytest.approx(1.0, abs=1e-6)
    # isotropic: 24 rows that are +-(scaled) basis vectors -> all 12 singular values equal
    isotropic = torch.cat([3 * torch.eye(12), -3 * torch.eye(12)]).double()
    assert effective_rank(isotropic) == pytest.approx(12.0)
    # rank 4 with equal singular values
    q, _ = torch.linalg.qr(torch.randn(40, 4, generator=generator, dtype=torch.float64))
    assert effective_rank(q @ torch.eye(12, dtype=torch.float64)[:4]) == pytest.approx(4.0)
    assert effective_rank(torch.zeros(5, 3)) == 0.0
    # from the Gram matrix, as the streaming observer computes it
    matrix = torch.randn(30, 8, generator=generator, dtype=torch.float64)
    assert effective_rank_from_gram(matrix.T @ matrix) == pytest.approx(effective_rank(matrix), rel=1e-9)


def test_update_effective_ranks_per_step():
    # step 0: every token moves along e1 (rank 1); step 1: tokens move along distinct axes
    tokens, d = 4, 4
    x0 = torch.zeros(tokens, d, dtype=torch.float64)
    x1 = x0 + torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    x2 = x1 + torch.eye(d, dtype=torch.float64)
    ranks = update_effective_ranks(torch.stack([x0, x1, x2]))
    torch.testing.assert_close(ranks, torch.tensor([1.0, 4.0], dtype=torch.float64))


def test_pca_recovers_a_plane():
    d = 20
    basis = _plane(d, seed=7)
    generator = torch.Generator().manual_seed(8)
    coords = torch.randn(200, 2, generator=generator, dtype=torch.float64) * torch.tensor([5.0, 1.0], dtype=torch.float64)
    offset = torch.randn(d, generator=generator, dtype=torch.float64)
    points = coords @ basis + offset
    fit = pca_2d(points)
    # the components span the plane: projecting them onto it loses nothing
    inside = fit.components @ basis.T @ basis
    torch.testing.assert_close(inside, fit.components)
    torch.testing.assert_close(fit.components @ fit.components.T, torch.eye(2, dtype=torch.float64))
    assert float(fit.explained_variance_ratio.sum()) == pytest.approx(1.0)
    assert fit.explained_variance_ratio[0] > fit.explained_variance_ratio[1]
    # distances are preserved by the projection (points lie in the fitted plane)
    projected = fit.project(points)
    torch.testing.assert_close(torch.cdist(projected, projected), torch.cdist(points, points), rtol=1e-9, atol=1e-6)


def test_convergence_steps_and_summaries():
    # token 0 contracts fast (relative step 0.5 then 0.05), token 1 never converges
    states = torch.zeros(4, 2, 1, dtype=torch.float64)
    states[:, 0, 0] = torch.tensor([1.0, 1.5, 1.575, 1.6])  # rel steps 0.5, 0.05, ~0.016
    states[:, 1, 0] = torch.tensor([1.0, 2.0, 4.0, 8.0])  # rel steps 1, 1, 1
    steps = convergence_steps(states, threshold=0.1)
    assert steps.tolist() == [1, 3]
    summary = summarize(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
    torch.testing.assert_close(summary["mean"], torch.tensor([2.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(summary["std"], torch.tensor([1.0, 0.0], dtype=torch.float64))


def test_bad_shapes_are_user_errors():
    with pytest.raises(RdepthError, match="shape"):
        step_sizes(torch.zeros(3, 4))
    with pytest.raises(RdepthError, match="at least 3 iterates"):
        step_cosines(torch.zeros(2, 4, 5))


def test_cosine_of_tiny_steps_is_exact_and_a_zero_step_gives_zero():
    """Steps of 1e-7 at a known angle (cos = 0.6): an additive 1e-12 in the denominator would read
    0.6 / (1 + 1e-12 / 1e-14) ~ 0.006; the exact cosine reads 0.6. A step that does not move gives 0."""
    from rdepth.geometry.metrics import step_cosines

    scale = 1e-7
    states = torch.tensor([[0.0, 0.0], [scale, 0.0], [scale + 0.6 * scale, 0.8 * scale],
                           [scale + 0.6 * scale, 0.8 * scale]], dtype=torch.float64).unsqueeze(1)  # [4, 1, 2]
    cosines = step_cosines(states)[:, 0]
    assert cosines[0].item() == pytest.approx(0.6, rel=1e-12)
    assert cosines[1].item() == 0.0


def test_plateau_and_settled_spread_headlines():
    from rdepth.geometry.summary import NOISE_FLOOR, plateau, settled_spread

    flat = [1.0] + [0.1] * 20  # levels off at a nonzero size
    contracting = [0.5 ** k for k in range(21)]  # halves every step: 1,024x over the window
    assert plateau(flat) == {"ratio": 1.0, "last_over_step1": 1.0, "window": 10, "holds": True}
    shrinking = plateau(contracting)
    assert shrinking["ratio"] == pytest.approx(2.0 ** -10) and not shrinking["holds"]
    at_floor = [1.0, 1.0] + [NOISE_FLOOR / 2] * 19  # level, but under 1e-3 of the first refinement step
    assert plateau(at_floor)["ratio"] == 1.0 and not plateau(at_floor)["holds"]
    assert plateau(flat[:10]) is None  # shorter than the window
    # over the settled window, cosines 2..6 (cosine 0 is the jump from the random start)
    assert settled_spread([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [0.5] * 7, None) == pytest.approx(0.5)
    assert settled_spread([0.1, 0.2, 0.3, 0.4], [0.5] * 4, 3) is None  # one usable cosine: no plateau

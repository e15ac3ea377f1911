"""The streaming observer equals the batch metric functions on the same iterates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.geometry import metrics
from rdepth.geometry.stream import GeometryObserver, Moments

STEPS = (3, 5, 2)


def _random_trajectories(batches: int, batch: int, seq: int, d: int, seed: int = 0):
    """Per batch, per group: iterates [K+1, B, T, d] that contract towards a random point."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        groups = []
        for steps in STEPS:
            target = torch.randn(batch, seq, d, generator=generator)
            states = [torch.randn(batch, seq, d, generator=generator)]
            for _ in range(steps):
                rate = torch.rand(batch, seq, 1, generator=generator)
                noise = 0.05 * torch.randn(batch, seq, d, generator=generator)
                states.append(states[-1] + rate * (target - states[-1]) + noise)
            groups.append(torch.stack(states))
        out.append(groups)
    return out


def _feed(observer, trajectories):
    for groups in trajectories:
        for group, states in enumerate(groups):
            for step in range(states.shape[0]):
                observer(group, step, states[step], None)


def _flat(trajectories, group):
    """All batches of one group as [K+1, N, d], rows ordered batch, sequence, position."""
    parts = [groups[group].reshape(groups[group].shape[0], -1, groups[group].shape[-1]) for groups in trajectories]
    return torch.cat(parts, dim=1)


def test_stream_matches_batch_functions():
    trajectories = _random_trajectories(batches=3, batch=2, seq=5, d=8)
    observer = GeometryObserver(threshold=0.3, keep_sequence=3)
    _feed(observer, trajectories)
    result = observer.result()
    assert result.tokens == 3 * 2 * 5
    for group, steps in enumerate(STEPS):
        states = _flat(trajectories, group)
        got = result.groups[group]
        assert int(got["steps"]) == steps
        reference = {
            "step_size": metrics.step_sizes(states),
            "relative_step_size": metrics.relative_step_sizes(states),
            "cosine": metrics.step_cosines(states),
            "acceleration": metrics.accelerations(states),
        }
        for name, values in reference.items():
            summary = metrics.summarize(values)
            np.testing.assert_allclose(got[f"{name}_mean"], summary["mean"].numpy(), rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(got[f"{name}_std"], summary["std"].numpy(), rtol=1e-8, atol=1e-12)
            assert got[f"{name}_count"].tolist() == [states.shape[1]] * values.shape[0]
        np.testing.assert_allclose(
            got["effective_rank"], metrics.update_effective_ranks(states).numpy(), rtol=1e-4
        )
        np.testing.assert_array_equal(
            got["convergence_step"], metrics.convergence_steps(states, 0.3).numpy()
        )
        np.testing.assert_allclose(
            got["final_relative_step_size"], metrics.relative_step_sizes(states)[-1].numpy(), rtol=1e-12
        )
    for (a, b) in ((0, 1), (1, 2)):
        for definition in metrics.DLR_DEFINITIONS:
            expected = metrics.drift_to_loop_ratio(
                _flat(trajectories, a), _flat(trajectories, b), definition=definition
            )
            np.testing.assert_allclose(result.boundaries[f"{a}->{b}"][definition], expected.numpy(), rtol=1e-10)
    # sequence 3 = batch 1, row 1: its full iterates per group
    assert len(result.kept_states) == 3
    for group in range(3):
        np.testing.assert_array_equal(result.kept_states[group], trajectories[1][group][:, 1].numpy())


def test_stream_dlr_under_both_denominators_on_a_constructed_hand_off():
    """Eq. 2's denominator vs the refinement steps, per token, through the observer; NaN after one step."""
    e1, e2, e3 = torch.eye(3, dtype=torch.float64)
    # group 0 (3 steps): x^(0) = 20 e2, then 0, e1, e1 + e3 -> steps 20, 1, 1 (token 0); token 1 = twice that
    prev = torch.stack([20 * e2, torch.zeros(3), e1, e1 + e3])
    group0 = torch.stack([prev, 2 * prev], dim=1)[:, None]  # [K+1, B=1, T=2, d]
    # group 1 (1 step): x^(1) = output + 2 e1, token by token
    group1 = torch.stack([torch.stack([5 * e2, 5 * e2]), group0[-1, 0] + 2 * e1])[:, None]
    # group 2 (2 steps) after the one-step group 1: no refinement step to divide by
    group2 = torch.stack([torch.zeros(2, 3), group1[-1, 0] + e3, group1[-1, 0] + 2 * e3])[:, None]
    observer = GeometryObserver(threshold=1e-9, keep_sequence=None, rank=False)
    _feed(observer, [[group0, group1, group2]])
    result = observer.result()
    first = result.boundaries["0->1"]
    np.testing.assert_allclose(first["first"], [2 / (22 / 3), 2 / (44 / 3)], rtol=1e-10)
    np.testing.assert_allclose(first["first_refine"], [2.0, 1.0], rtol=1e-10)
    second = result.boundaries["1->2"]
    assert np.isnan(second["first_refine"]).all() and np.isnan(second["literal_refine"]).all()
    group1_steps = (group1[1, 0] - group1[0, 0]).norm(dim=-1).numpy()
    np.testing.assert_allclose(second["first"], 1.0 / group1_steps, rtol=1e-10)
    for definition in metrics.DLR_DEFINITIONS:  # the batch function gives the same, NaN included
        for boundary, (a, b) in (("0->1", (group0, group1)), ("1->2", (group1, group2))):
            expected = metrics.drift_to_loop_ratio(a[:, 0], b[:, 0], definition).numpy()
            np.testing.assert_allclose(result.boundaries[boundary][definition], expected, rtol=1e-10)


def test_stream_refine_denominator_counts_each_rows_own_steps():
    """A row that stops early divides by the mean of the steps it ran after its first."""
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # group 0: token 0 moves 8, 1, 3 (runs 3 steps); token 1 moves 8, 2 and stops (inactive at step 3)
    token0 = torch.stack([torch.zeros(2), 8 * e1, 9 * e1, 12 * e1])
    token1 = torch.stack([torch.zeros(2), 8 * e1, 10 * e1, 10 * e1])
    group0 = torch.stack([token0, token1], dim=1)[:, None]
    handed = group0[-1, 0]
    group1 = torch.stack([torch.zeros(2, 2), handed + torch.tensor([0.0, 3.0], dtype=torch.float64)])[:, None]
    observer = GeometryObserver(threshold=1e-9, keep_sequence=None, rank=False)
    observer(0, 0, group0[0], None)
    observer(0, 1, group0[1], None)
    observer(0, 2, group0[2], None)
    observer(0, 3, group0[3], torch.tensor([[True, False]]))
    observer(1, 0, group1[0], None)
    observer(1, 1, group1[1], None)
    dlr = observer.result().boundaries["0->1"]
    np.testing.assert_allclose(dlr["first"], [3 / 4, 3 / 5], rtol=1e-10)  # means (8+1+3)/3, (8+2)/2
    np.testing.assert_allclose(dlr["first_refine"], [3 / 2, 3 / 2], rtol=1e-10)  # means (1+3)/2, 2/1


def test_active_mask_leaves_stopped_rows_out():
    # one batch, one sequence of 2 tokens, one group; token 1 stops after step 1
    d = 4
    generator = torch.Generator().manual_seed(5)
    states = torch.randn(4, 1, 2, d, generator=generator)
    states[2:, 0, 1] = states[1, 0, 1]  # frozen once inactive
    active = torch.tensor([[True, False]])
    observer = GeometryObserver(threshold=1e-9, keep_sequence=None)
    observer(0, 0, states[0], None)
    observer(0, 1, states[1], None)
    observer(0, 2, states[2], active)
    observer(0, 3, states[3], active)
    got = observer.result().groups[0]
    assert got["step_size_count"].tolist() == [2, 1, 1]
    token0 = metrics.step_sizes(states[:, 0, :1])[:, 0]
    np.testing.assert_allclose(got["step_size_mean"][1:], token0[1:].numpy(), rtol=1e-12)
    assert got["cosine_count"].tolist() == [1, 1]
    # token 1 ran one step and never converged: its convergence step is the steps it ran
    assert got["convergence_step"].tolist() == [3, 1]


def test_moments_merge_equals_one_pass():
    values = torch.randn(100, dtype=torch.float64)
    moments = Moments()
    for chunk in values.split(7):
        moments.add(0, chunk)
    summary = moments.summary()
    assert summary["mean"][0] == pytest.approx(float(values.mean()))
    assert summary["std"][0] == pytest.approx(float(values.std(correction=0)))


def test_out_of_order_calls_are_rejected():
    observer = GeometryObserver()
    state = torch.zeros(1, 2, 3)
    observer(0, 0, state, None)
    with pytest.raises(RdepthError, match="out of order"):
        observer(0, 2, state, None)
    with pytest.raises(RdepthError, match="threshold"):
        GeometryObserver(threshold=0)

"""Vectorised replay against a literal, token-by-token transcription of Algorithm 1."""

from __future__ import annotations

import pytest
import torch

from rdepth.exits import replay


def _acceleration(delta_cur, delta_prev):
    return torch.linalg.vector_norm(delta_cur - delta_prev)


def _acceleration_rel(delta_cur, delta_prev, eps=1e-6):
    return torch.linalg.vector_norm(delta_cur - delta_prev) / (
        torch.linalg.vector_norm(delta_cur) + torch.linalg.vector_norm(delta_prev) + eps
    )


def algorithm1(trajectory: torch.Tensor, tau: float, k_max: int, signal=_acceleration) -> tuple[int, int]:
    """Algorithm 1 line by line for one token; the block map f reads the next
    recorded state. Returns (index of x*, loop steps computed)."""
    cursor = 0

    def f(x0):
        nonlocal cursor
        cursor += 1
        return trajectory[cursor]

    x0 = trajectory[0]
    k = 0
    delta_prev = None
    prev_small = False
    while k < k_max:
        x1 = f(x0)
        delta_cur = x1 - x0
        if delta_prev is not None:
            a = signal(delta_cur, delta_prev)
            small = bool(a < tau)
            if small and prev_small:
                break
            prev_small = small
        delta_prev = delta_cur
        x0 = x1
        k = k + 1
    assert torch.equal(x0, trajectory[k])  # x* is the k-th state
    return k, cursor


def random_trajectories(n: int, steps: int, dim: int, seed: int) -> torch.Tensor:
    """Noisy contractions with per-token rates: states [steps+1, n, dim] (float64)."""
    generator = torch.Generator().manual_seed(seed)
    rate = 0.5 + 0.45 * torch.rand(n, 1, generator=generator, dtype=torch.float64)
    target = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    state = torch.randn(n, dim, generator=generator, dtype=torch.float64) * 3
    states = [state]
    for k in range(steps):
        noise = torch.randn(n, dim, generator=generator, dtype=torch.float64) * 0.05 * 0.8**k
        state = target + rate * (state - target) + noise
        states.append(state)
    return torch.stack(states)


@pytest.mark.parametrize("name, signal", [("acceleration", _acceleration), ("acceleration_rel", _acceleration_rel)])
def test_vectorised_replay_equals_the_literal_loop(name, signal):
    states = random_trajectories(n=60, steps=14, dim=8, seed=1)
    taus = torch.logspace(-4, 1, 25).tolist()
    exit_steps = set()
    for k_max in (14, 9, 3):
        for tau in taus:
            used, computed = replay(name, states, tau=tau, k_max=k_max)
            for token in range(states.shape[1]):
                expected = algorithm1(states[:, token], tau, k_max, signal)
                assert (int(used[token]), int(computed[token])) == expected, (tau, k_max, token)
                exit_steps.add(expected)
    # The grid exercises early exits, late exits and tokens that never exit.
    assert any(u == c - 1 for u, c in exit_steps) and any(u == c for u, c in exit_steps)
    assert len({c for _, c in exit_steps}) >= 8

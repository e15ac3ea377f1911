"""Similarity, dynamics and retention metrics against hand-computed answers."""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.surrogate.measure.dynamics import (
    angular_convergence,
    effective_rank,
    mean_direction_coherence,
    update_effective_rank,
)
from rdepth.surrogate.measure.fidelity import fidelity, probe_accuracy, ridge_probe, spearman, text_retention
from rdepth.surrogate.measure.similarity import cka, linear_cka, pooled_cosine, token_cosine

pytestmark = pytest.mark.usefixtures("one_thread")

def test_cka_identity_orthogonal_and_scale_invariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-12)
    assert float(linear_cka(x, x @ q)) == pytest.approx(1.0, abs=1e-12)
    assert float(linear_cka(x, 7.5 * x)) == pytest.approx(1.0, abs=1e-12)
    y = torch.randn(200, 8, generator=g, dtype=torch.float64)
    value = float(linear_cka(x, y))
    assert float(linear_cka(3.0 * x @ q, y)) == pytest.approx(value, abs=1e-12)
    assert 0.0 < value < 0.5  # unrelated random features


def test_cka_not_invariant_to_anisotropic_scaling():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 4, generator=g, dtype=torch.float64)
    assert float(linear_cka(x, x * torch.tensor([10.0, 1.0, 1.0, 1.0], dtype=torch.float64))) < 0.99


def test_cosine_matrices_on_constructed_states():
    # depth 1 = depth 0 scaled (cos 1), depth 2 = negated (cos -1)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, 5, 8, generator=g)
    states = torch.stack([base, 2.0 * base, -base])
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    for fn in (pooled_cosine, token_cosine, cka):
        s = fn(states, mask)
        assert s.shape == (3, 3)
        assert torch.allclose(torch.diagonal(s), torch.ones(3, dtype=torch.float64))
        assert float(s[0, 1]) == pytest.approx(1.0, abs=1e-9)
    assert float(token_cosine(states, mask)[0, 2]) == pytest.approx(-1.0, abs=1e-9)
    assert float(pooled_cosine(states, mask)[0, 2]) == pytest.approx(-1.0, abs=1e-9)


def test_pooled_cosine_ignores_padding():
    states = torch.zeros(2, 1, 3, 2)
    states[0, 0, 0] = torch.tensor([1.0, 0.0])
    states[1, 0, 0] = torch.tensor([0.0, 1.0])
    states[:, 0, 1:] = 5.0  # padding, identical at both depths
    mask = torch.tensor([[True, False, False]])
    assert float(pooled_cosine(states, mask)[0, 1]) == pytest.approx(0.0, abs=1e-12)


def test_effective_rank_known_answers():
    assert effective_rank(torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.0]))) == pytest.approx(3.0, rel=1e-9)
    rank_one = torch.outer(torch.arange(1.0, 6.0), torch.tensor([1.0, -2.0, 0.5]))
    assert effective_rank(rank_one) == pytest.approx(1.0, rel=1e-6)


def test_dynamics_on_rotation():
    # every token rotates by 30 degrees per layer in a plane
    angles = torch.deg2rad(torch.tensor([0.0, 30.0, 60.0]))
    directions = torch.stack([torch.cos(angles), torch.sin(angles)], -1)  # (3, 2)
    states = directions[:, None, None, :].expand(3, 2, 4, 2).clone()
    mask = torch.ones(2, 4, dtype=torch.bool)
    result = angular_convergence(states, mask)
    assert result["step_first"] == pytest.approx([30.0, 30.0], abs=1e-4)
    assert result["step_others"] == pytest.approx([30.0, 30.0], abs=1e-4)
    assert result["to_final_others"] == pytest.approx([60.0, 30.0, 0.0], abs=1e-4)
    coherence = mean_direction_coherence(states, mask)
    assert coherence["others"] == pytest.approx([1.0, 1.0, 1.0])
    assert coherence["first"] == pytest.approx([1.0, 1.0, 1.0])
    ranks = update_effective_rank(states, mask)
    assert len(ranks) == 2 and all(r == 0.0 or r == pytest.approx(1.0) for r in ranks)


def test_spearman_and_retention():
    x = torch.tensor([0.1, 0.5, 0.3, 0.9])
    assert spearman(x, x * 3 + 1) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    g = torch.Generator().manual_seed(3)
    e = torch.nn.functional.normalize(torch.randn(20, 6, generator=g), dim=-1)
    same = text_retention(e, e)
    assert same["embedding_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert same["pairwise_spearman"] == pytest.approx(1.0)
    assert same["nn_top1"] == 1.0 and same["nn_overlap@10"] == 1.0
    other = torch.nn.functional.normalize(torch.randn(20, 6, generator=g), dim=-1)
    assert text_retention(other, e)["pairwise_spearman"] < 0.5


def test_fidelity_exact_and_probe():
    g = torch.Generator().manual_seed(4)
    states = torch.randn(3, 4, 5, 6, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    exact = fidelity(states, states, mask, torch.nn.Identity())
    assert exact["layer_rel_mse"] == [0.0, 0.0] and exact["final_rel_mse"] == 0.0
    assert exact["final_cosine"] == pytest.approx(1.0)
    doubled = fidelity(2 * states, states, mask, torch.nn.Identity())
    assert doubled["final_rel_mse"] == pytest.approx(1.0) and doubled["final_cosine"] == pytest.approx(1.0)
    # linearly separable classes: the ridge probe is perfect
    features = torch.randn(60, 3, generator=g)
    labels = (features[:, 0] > 0).long()
    features[:, 0] += torch.where(labels == 1, 5.0, -5.0)
    assert probe_accuracy(ridge_probe(features, labels, 2), features, labels) == 1.0
    assert not math.isnan(exact["final_cosine"])

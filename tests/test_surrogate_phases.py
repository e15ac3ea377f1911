"""Phase discovery: the dynamic programme is exact, max-cut and block scores on known matrices."""

from __future__ import annotations

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.surrogate.phases import (
    all_segmentations,
    block_structure,
    brute_force_phases,
    dp_phases,
    equal_phases,
    max_cut_phases,
    segmentation_score,
)

pytestmark = pytest.mark.usefixtures("one_thread")

def random_symmetric(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, n, generator=g, dtype=torch.float64) * 2 - 1
    s = (a + a.T) / 2
    s.fill_diagonal_(1.0)
    return s


@pytest.mark.parametrize("n_layers,k", [(1, 1), (4, 2), (6, 2), (6, 3), (7, 4), (8, 3), (9, 5), (10, 10), (12, 4)])
def test_dp_equals_brute_force(n_layers, k):
    for seed in range(5):
        s = random_symmetric(n_layers, seed * 100 + n_layers * 10 + k)
        lengths = dp_phases(s, k)
        best_lengths, best_score = brute_force_phases(s, k)
        assert len(lengths) == k and sum(lengths) == n_layers and min(lengths) >= 1
        assert segmentation_score(s, lengths) == pytest.approx(best_score, abs=1e-10)
        assert lengths == best_lengths  # unique optimum with continuous random entries


def test_all_segmentations_counts():
    # C(L-1, k-1) compositions
    assert len(all_segmentations(8, 3)) == 21
    assert all(sum(x) == 8 for x in all_segmentations(8, 3))


def block_matrix(lengths, within=0.9, between=0.1):
    label = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    s = torch.where(label[:, None] == label[None, :], within, between).double()
    s.fill_diagonal_(1.0)
    return s


@pytest.mark.parametrize("lengths", [(2, 5), (4, 1, 3), (1, 1, 6), (3, 3, 2, 4)])
def test_planted_blocks_are_recovered_by_dp(lengths):
    assert dp_phases(block_matrix(lengths), len(lengths)) == lengths


@pytest.mark.parametrize("lengths", [(2, 5), (4, 1, 3), (3, 3, 2, 4)])
def test_planted_blocks_are_recovered_by_maxcut(lengths):
    assert max_cut_phases(block_matrix(lengths), len(lengths)) == lengths


def test_maxcut_first_cut_by_hand():
    # W = 1 - S: 0.9 across blocks (1, 1, 6), 0.1 within. Cut weights of the first bisection:
    # at 1: 7 * 0.9 = 6.3; at 2: 2 * 6 * 0.9 = 10.8; at 3: 10 * 0.9 + 5 * 0.1 = 9.5 -> cut at 2.
    # Unnormalised max-cut prefers balanced cuts, so it cannot isolate the two singletons first.
    assert max_cut_phases(block_matrix((1, 1, 6)), 2) == (2, 6)


def test_block_structure_known_values():
    s = block_matrix((3, 3), within=0.8, between=0.2)
    scores = block_structure(s, (3, 3))
    assert scores["within"] == pytest.approx(0.8)
    assert scores["between"] == pytest.approx(0.2)
    assert scores["contrast"] == pytest.approx(0.6)
    assert scores["variance_explained"] == pytest.approx(1.0)
    wrong = block_structure(s, (1, 5))
    assert wrong["variance_explained"] < 1.0


def test_equal_phases_and_errors():
    assert equal_phases(6, 2) == (3, 3)
    assert equal_phases(7, 3) == (3, 2, 2)
    assert equal_phases(4, 4) == (1, 1, 1, 1)
    with pytest.raises(RdepthError, match="k must be"):
        equal_phases(3, 4)
    with pytest.raises(RdepthError, match="k must be"):
        dp_phases(torch.eye(3), 0)
    with pytest.raises(RdepthError, match="square"):
        dp_phases(torch.zeros(3, 4), 1)


def _planted_bank(lengths: tuple[int, ...], seed: int, n_batches: int = 2):
    """A StateBank whose layer outputs 1..L point, per phase of ``lengths``, along one direction (plus noise)."""
    from rdepth.surrogate.bank import BankBatch, StateBank

    g = torch.Generator().manual_seed(seed)
    d, n_layers = 8, sum(lengths)
    directions = torch.eye(d)[: len(lengths)] * 5.0
    phase_of = [p for p, n in enumerate(lengths) for _ in range(n)]
    batches = []
    for _ in range(n_batches):
        noise = torch.randn(n_layers + 1, 4, 6, d, generator=g)
        states = noise.clone()
        for depth, phase in enumerate(phase_of, start=1):
            states[depth] += directions[phase]
        mask = torch.ones(4, 6, dtype=torch.bool)
        mask[0, 4:] = False
        batches.append(BankBatch(torch.zeros(4, 6, dtype=torch.long), mask, states))
    return StateBank(batches)


@pytest.mark.parametrize("method", ["dp", "maxcut"])
def test_phases_are_chosen_on_the_fit_set_not_the_evaluation_set(method):
    """Fit and held-out states with different planted phases: the surrogate gets the fit set's."""
    from rdepth.surrogate.run import choose_phases

    fit, held_out = _planted_bank((1, 4), seed=0), _planted_bank((4, 1), seed=1)
    chosen, matrices, record = choose_phases(fit, held_out, 2, "pooled_cosine", method)
    assert chosen == (1, 4)
    assert record["chosen_on"] == "fit" and record["chosen"] == [1, 4]
    assert record["by_similarity"]["pooled_cosine"][method]["lengths"] == [1, 4]
    assert record["by_similarity_eval"]["pooled_cosine"][method]["lengths"] == [4, 1]  # measured, not used
    assert set(matrices) == {"fit", "eval"} and matrices["fit"]["pooled_cosine"].shape == (6, 6)
    chosen_swapped, _, _ = choose_phases(held_out, fit, 2, "pooled_cosine", method)
    assert chosen_swapped == (4, 1)

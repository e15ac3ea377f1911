"""bench/exit_workload.py: the mixed workload's references (issue 38), on constructed cases with known
answers, and the combined held-out set against its parts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from exit_workload import mixed_heldout, oracle_budgets, router_budgets, steps_by_difficulty, window_solved  # noqa: E402


def test_the_oracle_takes_each_problems_smallest_solving_budget_and_the_full_one_when_none_does():
    solved = {1: np.array([True, False, False, False]), 2: np.array([True, True, False, False]),
              3: np.array([False, True, True, False]), 4: np.array([True, False, True, False])}
    # window 1 is solved at 2 (lost at 4: the oracle still takes 2); window 3 never: the full budget
    assert oracle_budgets(solved, 4).tolist() == [1, 2, 3, 4]


def test_the_router_takes_each_difficultys_cheapest_budget_within_the_tolerance_of_its_full_budget():
    labels = np.array([1, 1, 1, 1, 8, 8, 8, 8])
    solved = {1: np.array([1, 1, 1, 0, 0, 0, 0, 0], bool), 2: np.array([1, 1, 1, 1, 0, 0, 1, 0], bool),
              3: np.array([1, 1, 1, 1, 1, 1, 1, 0], bool), 4: np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)}
    assert router_budgets(solved, labels, 4, tolerance=0.0) == {1: 2, 8: 3}
    assert router_budgets(solved, labels, 4, tolerance=0.3) == {1: 1, 8: 3}  # d1: 75% within 0.3 of 100%
    # a router that ignored the difficulty would give both the same budget: these differ
    assert len(set(router_budgets(solved, labels, 4, 0.0).values())) == 2


def _heldout(difficulty, windows, answers_per_window=2, width=9):
    from rdepth.tasks.data import HeldOut

    tokens = np.arange(windows * width).reshape(windows, width) % 7
    mask = np.zeros((windows, width), bool)
    ids = np.full((windows, width), -1)
    for w in range(windows):
        mask[w, 3:3 + answers_per_window] = True
        ids[w, 3:3 + answers_per_window] = w
    return HeldOut(difficulty, tokens, mask, ids)


def test_the_mixed_set_puts_the_timed_windows_first_and_keeps_problem_ids_apart(monkeypatch):
    import rdepth.tasks.data as data

    parts = {1: _heldout(1, 5), 8: _heldout(8, 5)}
    monkeypatch.setattr(data, "load_heldout", lambda folder, difficulty: parts[difficulty])
    heldout, labels = mixed_heldout("unused", [1, 8], problems=4, timed=2)
    assert labels.tolist() == [1, 1, 8, 8, 1, 1, 8, 8]
    assert heldout.tokens.shape[0] == 8
    ids = heldout.problem_ids[heldout.problem_ids >= 0]
    assert len(set(ids.tolist())) == 8  # 4 problems of each, none shared
    np.testing.assert_array_equal(heldout.tokens[2], parts[8].tokens[0])
    np.testing.assert_array_equal(heldout.tokens[4], parts[1].tokens[2])


def test_window_solved_needs_every_answer_and_steps_split_by_difficulty():
    heldout = _heldout(0, 3)  # 2 answers per window, targets at mask[:, 1:] columns 2-3
    right = np.array([True, True, True, False, True, True])
    assert window_solved(heldout, right).tolist() == [True, False, True]
    labels = np.array([1, 1, 8])
    steps = np.array([1, 1, 2, 2, 5, 7], dtype=float)
    assert steps_by_difficulty(heldout, labels, steps) == {1: 1.5, 8: 6.0}

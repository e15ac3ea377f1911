"""A mixed held-out workload for ``bench/exit_wall.py task --difficulties ...`` (issue 38): equal shares of
several difficulties, and the two references an exit rule is judged beside on it.

- **oracle**: each problem decoded at the smallest fixed budget that solves it (every answer of the
  problem right; a problem no budget up to the full one solves runs the full budget and stays wrong);
- **router**: each problem decoded at its difficulty's cheapest fixed budget whose accuracy on that
  difficulty is within the tolerance of the full budget's there (a router told the difficulty).

Both are per-window fixed budgets (a chase problem is one window), so they decode on the one decoder
exactly like a fixed budget. Functions only: exit_wall.py owns the measuring.
"""

from __future__ import annotations

import numpy as np


def mixed_heldout(data: str, difficulties: list[int], problems: int, timed: int):
    """One HeldOut of ``problems`` problems of each difficulty, ids made unique, ordered so that the first
    ``timed * len(difficulties)`` windows are the first ``timed`` of each difficulty (the timed rounds
    decode those); returns (heldout, difficulty of each window [W])."""
    from rdepth.tasks.data import HeldOut, load_heldout

    heads, tails, offset = [], [], 0
    for difficulty in difficulties:
        part = load_heldout(data, difficulty).first_problems(problems)
        ids = np.where(part.problem_ids >= 0, part.problem_ids + offset, -1)
        offset = int(ids.max()) + 1
        part = HeldOut(difficulty, part.tokens, part.answer_mask, ids)
        heads.append((difficulty, part.windows(0, timed)))
        tails.append((difficulty, part.windows(timed)))
    parts = heads + tails
    combined = HeldOut(0, *(np.concatenate([getattr(p, name) for _, p in parts])
                            for name in ("tokens", "answer_mask", "problem_ids")))
    labels = np.concatenate([np.full(p.tokens.shape[0], d) for d, p in parts])
    return combined, labels


def window_solved(heldout, answer_right: np.ndarray) -> np.ndarray:
    """bool [W]: every answer of each window right (``answer_right`` row-major over ``answer_mask[:, 1:]``)."""
    per_window = heldout.answer_mask[:, 1:].astype(bool).sum(axis=1)
    bounds = np.concatenate([[0], np.cumsum(per_window)])
    return np.array([bool(answer_right[a:b].all()) and b > a for a, b in zip(bounds[:-1], bounds[1:], strict=False)])


def oracle_budgets(solved: dict[int, np.ndarray], full: int) -> np.ndarray:
    """int [W]: per window the smallest budget k (keys of ``solved``: bool [W] per k) that solves it, else
    ``full``."""
    budgets = np.full(next(iter(solved.values())).shape[0], full)
    for k in sorted(solved, reverse=True):
        budgets[solved[k]] = k
    return budgets


def router_budgets(solved: dict[int, np.ndarray], labels: np.ndarray, full: int, tolerance: float) -> dict[int, int]:
    """Per difficulty the cheapest budget k whose accuracy on that difficulty's windows is at least the
    full budget's there less ``tolerance``."""
    choice = {}
    for difficulty in sorted(set(labels.tolist())):
        rows = labels == difficulty
        bar = solved[full][rows].mean() - tolerance
        choice[int(difficulty)] = min(k for k in sorted(solved) if solved[k][rows].mean() >= bar - 1e-12)
    return choice


def steps_by_difficulty(heldout, labels: np.ndarray, answer_steps: np.ndarray) -> dict[int, float]:
    """Mean loop steps of answer tokens per difficulty (``answer_steps`` row-major like ``answer_right``)."""
    mask = heldout.answer_mask[:, 1:].astype(bool)
    owner = np.broadcast_to(labels[:, None], mask.shape)[mask]
    return {int(d): float(answer_steps[owner == d].mean()) for d in sorted(set(labels.tolist()))}

"""Honest selection: a setting chosen on one half of the held-out problems, judged on the other.

The task sweep's summary picks the cheapest policy setting within the tolerance of the full budget on
the same problems it reports, so its accuracy is optimistic by the choice. Here the problems are split
in two halves by their id (even ids: half A, odd: half B); the setting (and the cheapest fixed budget
at least as accurate) is chosen on one half and its accuracy and answer-token steps are reported on the
other, in both directions. Pure functions of per-answer-token arrays the sweep already computes
(:func:`rdepth.tasks.evaluate.heldout_accuracy` with ``per_token``); numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

HALVES = ("A", "B")  # even problem ids, odd problem ids


def target_problems(answer_mask: np.ndarray, problem_ids: np.ndarray) -> np.ndarray:
    """The problem id of each answer target ``[N]``, in the row-major order of ``answer_mask[:, 1:]`` (the
    order of ``answer_right`` / ``answer_steps``)."""
    mask = answer_mask[:, 1:].astype(bool)
    return problem_ids[:, 1:][mask].astype(np.int64)


def half_scores(right: np.ndarray, steps: np.ndarray, problems: np.ndarray) -> list[dict[str, float]]:
    """Per half (A: even problem ids, B: odd): the exact-match accuracy of its problems (a problem is solved
    when every answer target of it is right) and the mean steps of its answer targets."""
    right = np.asarray(right, dtype=bool)
    steps = np.asarray(steps, dtype=np.float64)
    out = []
    for parity in (0, 1):
        chosen = problems % 2 == parity
        ids = np.unique(problems[chosen])
        wrong = np.zeros(int(problems.max()) + 1 if problems.size else 0, dtype=bool)
        np.logical_or.at(wrong, problems[chosen & ~right], True)
        out.append({"problems": int(ids.size), "accuracy": float((~wrong[ids]).mean()) if ids.size else float("nan"),
                    "answer_steps": float(steps[chosen].mean()) if chosen.any() else float("nan")})
    return out


def _cheapest(entries: Sequence[dict], half: int, floor: float) -> dict | None:
    matched = [e for e in entries if e["halves"][half]["accuracy"] >= floor - 1e-12]
    return min(matched, key=lambda e: (e["halves"][half]["answer_steps"], -e["halves"][half]["accuracy"])) \
        if matched else None


def honest_selection(fixed: Sequence[dict], points: Sequence[dict], tolerance: float) -> list[dict[str, Any]]:
    """Both directions (choose on A, judge on B; choose on B, judge on A). ``fixed`` (by budget, the full
    budget last) and ``points`` (policy settings): dicts with ``label`` and ``halves`` (:func:`half_scores`).

    On the choosing half: the cheapest point (answer-token steps) within ``tolerance`` of the full budget's
    accuracy there, and the cheapest fixed budget at least as accurate as that point there. On the judging
    half: both entries' accuracy and steps, the full budget's accuracy, and whether the point still meets
    the bar (full budget's accuracy there minus ``tolerance``)."""
    rows = []
    for choose, judge in ((0, 1), (1, 0)):
        full = fixed[-1]
        point = _cheapest(points, choose, full["halves"][choose]["accuracy"] - tolerance)
        row: dict[str, Any] = {"chosen_on": HALVES[choose], "judged_on": HALVES[judge],
                               "full_accuracy": full["halves"][judge]["accuracy"], "point": None}
        if point is not None:
            bar = full["halves"][judge]["accuracy"] - tolerance
            row["point"] = {"label": point["label"], **point["halves"][judge],
                            "chosen_accuracy": point["halves"][choose]["accuracy"],
                            "meets_bar": point["halves"][judge]["accuracy"] >= bar - 1e-12}
            budget = _cheapest(fixed, choose, point["halves"][choose]["accuracy"])
            row["cheapest_fixed"] = None if budget is None else {"label": budget["label"], **budget["halves"][judge]}
        rows.append(row)
    return rows

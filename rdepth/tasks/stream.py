"""Problems as token sequences: a packed stream for training, whole-problem windows for evaluation.

``render_stream`` concatenates problems, each followed by ``<eot>``, and cuts
the stream at ``length``: most tokens are problem statements (easy to
predict or not predicted at all) and a few are answers (hard). The answer mask
is aligned with the tokens: ``mask[i]`` is True when ``tokens[i]`` is an answer
token, i.e. the target a model reading ``tokens[:i]`` should emit.

``pack_windows`` places whole problems into fixed-width windows (padded with
``<eot>``), so an evaluation never sees a problem cut in half.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from rdepth.data.task_vocab import EOT_ID
from rdepth.errors import RdepthError
from rdepth.tasks.base import Problem, Task

# One task, or (task, weight) pairs sampled in proportion to their weights.
TaskMix = Task | Sequence[tuple[Task, float]]


def as_mixture(tasks: TaskMix) -> tuple[list[Task], np.ndarray]:
    """(tasks, probabilities summing to 1) for a single task or a weighted list."""
    if isinstance(tasks, Task):
        return [tasks], np.ones(1)
    pairs = list(tasks)
    if not pairs or not all(isinstance(t, Task) and 0 < float(w) < math.inf for t, w in pairs):
        raise RdepthError("a task mixture needs (task, positive finite weight) pairs")
    weights = np.array([float(w) for _, w in pairs])
    return [t for t, _ in pairs], weights / weights.sum()


def check_difficulties(tasks: TaskMix, difficulties: Sequence[int], block_size: int | None = None) -> None:
    """RdepthError unless every task accepts (and, given ``block_size``, fits) every difficulty."""
    if len(difficulties) == 0:
        raise RdepthError("no difficulties given")
    for task in as_mixture(tasks)[0]:
        for difficulty in difficulties:
            if block_size is None:
                task.check_difficulty(difficulty)
            else:
                task.check_fits(difficulty, block_size)


def sample_problems(tasks: TaskMix, rng: np.random.Generator, difficulties: Sequence[int]) -> Iterator[Problem]:
    """Endless problems: each picks a task by weight, then a difficulty uniformly from ``difficulties``."""
    members, probabilities = as_mixture(tasks)
    check_difficulties(tasks, difficulties)
    choices = np.asarray(difficulties, dtype=np.int64)
    while True:
        task = members[int(rng.choice(len(members), p=probabilities))] if len(members) > 1 else members[0]
        yield task.sample(rng, int(rng.choice(choices)))


def render_stream(
    tasks: TaskMix, rng: np.random.Generator, difficulties: Sequence[int], length: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [length], answer_mask bool [length]): problems back to back, each then ``<eot>``."""
    if length < 1:
        raise RdepthError(f"stream length must be >= 1, got {length}")
    tokens = np.empty(length, dtype=np.int64)
    mask = np.zeros(length, dtype=bool)
    filled = 0
    for problem in sample_problems(tasks, rng, difficulties):
        chunk = len(problem.tokens) + 1
        take = min(chunk, length - filled)
        tokens[filled:filled + take] = (problem.tokens + (EOT_ID,))[:take]
        mask[filled:filled + take] = np.append(problem.answer_mask, False)[:take]
        filled += take
        if filled == length:
            return tokens, mask
    raise AssertionError("unreachable")


@dataclass
class Windows:
    """Whole problems packed into windows. All arrays are [W, width]:
    ``tokens`` int64 (``<eot>`` padding), ``answer_mask`` bool,
    ``problem_ids`` int64 (index into the packed problems at answer positions, -1 elsewhere)."""

    tokens: np.ndarray
    answer_mask: np.ndarray
    problem_ids: np.ndarray


def pack_windows(problems: Sequence[Problem], width: int) -> Windows:
    """Greedily pack ``problems`` in order (each followed by ``<eot>``) into windows of ``width`` tokens."""
    rows: list[tuple[list[int], list[bool], list[int]]] = []
    current: tuple[list[int], list[bool], list[int]] = ([], [], [])
    for problem_id, problem in enumerate(problems):
        chunk = len(problem.tokens) + 1
        if chunk > width:
            raise RdepthError(f"a {problem.task} problem of {chunk} tokens (with separator) does not "
                              f"fit a window of {width}")
        if len(current[0]) + chunk > width:
            rows.append(current)
            current = ([], [], [])
        mask = problem.answer_mask
        current[0].extend(problem.tokens + (EOT_ID,))
        current[1].extend(mask.tolist() + [False])
        current[2].extend(np.where(mask, problem_id, -1).tolist() + [-1])
    if current[0]:
        rows.append(current)
    tokens = np.full((len(rows), width), EOT_ID, dtype=np.int64)
    answer_mask = np.zeros((len(rows), width), dtype=bool)
    problem_ids = np.full((len(rows), width), -1, dtype=np.int64)
    for row, (row_tokens, row_mask, row_ids) in enumerate(rows):
        tokens[row, :len(row_tokens)] = row_tokens
        answer_mask[row, :len(row_mask)] = row_mask
        problem_ids[row, :len(row_ids)] = row_ids
    return Windows(tokens, answer_mask, problem_ids)

"""Per answer token, the hops its answer needs, recomputed from the problems in held-out windows.

A held-out window (:mod:`rdepth.tasks.data`) holds whole problems, each followed
by ``<eot>``; ``problem_ids`` numbers them in the order the writer drew them, and
a mixture draws its tasks in turn (problem ``p`` is a problem of task
``p mod len(tasks)``). Each problem's statement is cut out of its window and
handed to its task's :meth:`~rdepth.tasks.base.Task.answer_hops`, which parses
it like the checker does (it never reads the generator's answer slots): so a
prepared folder from before this module gets its hops too, and nothing is added
to the files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from rdepth.data.task_vocab import EOT_ID
from rdepth.errors import RdepthError
from rdepth.tasks.base import Task
from rdepth.tasks.data import HeldOut, task_manifest
from rdepth.tasks.registry import get_task


def manifest_tasks(directory: str | os.PathLike) -> list[Task]:
    """The tasks of a prepared folder, in the mixture's order, with their saved parameters."""
    return [get_task(entry["name"], **entry.get("params", {})) for entry in task_manifest(directory)["tasks"]]


def window_hops(tasks: Sequence[Task], tokens: np.ndarray, answer_mask: np.ndarray,
                problem_ids: np.ndarray) -> np.ndarray:
    """int64, the shape of ``tokens`` ``[W, L]``: at each answer position the hops its answer needs,
    -1 elsewhere. ``tasks``: the folder's tasks (problem ``p`` belongs to ``tasks[p % len(tasks)]``)."""
    tokens, answer_mask, problem_ids = np.asarray(tokens), np.asarray(answer_mask, bool), np.asarray(problem_ids)
    if not tokens.shape == answer_mask.shape == problem_ids.shape or tokens.ndim != 2:
        raise RdepthError(f"hops: tokens {tokens.shape}, answer mask {answer_mask.shape} and problem ids "
                          f"{problem_ids.shape} must be one [windows, length] shape")
    hops = np.full(tokens.shape, -1, dtype=np.int64)
    for row in range(tokens.shape[0]):
        ends = np.flatnonzero(tokens[row] == EOT_ID)
        start = 0
        for end in ends.tolist() + [tokens.shape[1]]:
            answers = np.flatnonzero(answer_mask[row, start:end]) + start
            if answers.size:
                ids = np.unique(problem_ids[row, answers])
                if ids.size != 1 or ids[0] < 0:
                    raise RdepthError(f"hops: window {row} holds answers of problems {ids.tolist()} between two "
                                      "separators")
                task = tasks[int(ids[0]) % len(tasks)]
                counts = task.answer_hops(tokens[row, start:end].tolist())
                if len(counts) != answers.size:
                    raise RdepthError(f"hops: problem {int(ids[0])} has {answers.size} answer tokens but {task.name} "
                                      f"counts {len(counts)} answers")
                hops[row, answers] = counts
            start = end + 1
    return hops


def heldout_hops(tasks: Sequence[Task], heldout: HeldOut) -> np.ndarray:
    """int64 ``[N]``: the hops of every answer *target* of ``heldout`` (``answer_mask[:, 1:]``), in row-major
    order, the order in which :func:`rdepth.tasks.evaluate.heldout_accuracy` records per-token results."""
    hops = window_hops(tasks, heldout.tokens, heldout.answer_mask, heldout.problem_ids)
    return hops[:, 1:][heldout.answer_mask[:, 1:]]

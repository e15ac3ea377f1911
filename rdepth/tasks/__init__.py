"""Procedural reasoning tasks where depth (sequential computation) is the bottleneck.

Every task samples problems of a chosen *difficulty* (the number of
sequential steps its answer needs) in one shared vocabulary, and checks an
answer by recomputing it from the statement. Problems pack into streams (many
problems per sequence, answers a small share of the tokens) and into folders
that open like any prepared corpus, with answer masks and held-out sets
per difficulty, including difficulties above the training range.

- :mod:`~rdepth.data.task_vocab`: ``TaskVocab`` (tokenizer interface), ``load_task_vocab``
- :mod:`~rdepth.tasks.base`: ``Problem``, ``Task``
- :mod:`~rdepth.tasks.chase`, :mod:`~rdepth.tasks.modsum`, :mod:`~rdepth.tasks.assign`: the tasks
- :mod:`~rdepth.tasks.registry`: ``TASKS``, ``get_task``, ``parse_mixture``
- :mod:`~rdepth.tasks.stream`: ``render_stream``, ``pack_windows``
- :mod:`~rdepth.tasks.data`: ``TaskDataConfig``, ``prepare_task_data``, ``load_heldout``, ``answer_masks``
- :mod:`~rdepth.tasks.accuracy`: ``answer_accuracy``, ``problem_correct``
"""

from rdepth.data.task_vocab import TaskVocab, load_task_vocab
from rdepth.tasks.accuracy import answer_accuracy, problem_correct
from rdepth.tasks.base import Problem, Task
from rdepth.tasks.data import HeldOut, TaskDataConfig, answer_masks, load_heldout, prepare_task_data, task_manifest
from rdepth.tasks.registry import TASKS, get_task, parse_mixture, task_spec
from rdepth.tasks.stream import Windows, pack_windows, render_stream, sample_problems

__all__ = [
    "HeldOut", "Problem", "TASKS", "Task", "TaskDataConfig", "TaskVocab", "Windows", "answer_accuracy",
    "answer_masks", "get_task", "load_heldout", "load_task_vocab", "pack_windows", "parse_mixture",
    "prepare_task_data", "problem_correct", "render_stream", "sample_problems", "task_manifest", "task_spec",
]

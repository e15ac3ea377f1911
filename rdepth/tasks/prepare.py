"""``rdepth prepare`` as one call: a text corpus through :mod:`rdepth.data.prepare`, or a
reasoning task (``--corpus task:NAME``) through :func:`rdepth.tasks.data.prepare_task_data`."""

from __future__ import annotations

from typing import Any

from rdepth.data.prepare import PrepareConfig, prepare_and_describe
from rdepth.errors import RdepthError
from rdepth.tasks.data import TaskDataConfig, describe_task_data, prepare_task_data

TASK_PREFIX = "task:"


def prepare_any(config: PrepareConfig, task_fields: dict[str, Any]) -> list[str]:
    """Prepare ``config.corpus``; ``task_fields`` (TaskDataConfig fields) apply to a task only."""
    if not config.corpus.startswith(TASK_PREFIX):
        if task_fields:
            raise RdepthError(f"{', '.join('--' + k.replace('_', '-') for k in task_fields)} "
                              "apply only to --corpus task:NAME")
        return prepare_and_describe(config)
    task = TaskDataConfig(task=config.corpus, seed=config.seed, out=config.out, **task_fields)
    return describe_task_data(prepare_task_data(task))

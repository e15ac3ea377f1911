"""``rdepth prepare`` as one call: a text corpus through :mod:`rdepth.data.prepare`, or a
reasoning task (``--corpus task:NAME``) through :func:`rdepth.tasks.data.prepare_task_data`."""

from __future__ import annotations

from typing import Any

from rdepth.data.prepare import PrepareConfig, prepare_and_describe
from rdepth.errors import RdepthError
from rdepth.tasks.data import TaskDataConfig, describe_task_data, prepare_task_data

TASK_PREFIX = "task:"


# PrepareConfig fields that shape a text corpus only; a task generates its own vocabulary and split.
TEXT_ONLY = ("tokenizer", "val_fraction", "max_documents", "cache_dir", "bundle", "bundle_mib", "workers")


def prepare_any(config: PrepareConfig, task_fields: dict[str, Any], text_fields: Any = ()) -> list[str]:
    """Prepare ``config.corpus``; ``task_fields`` (TaskDataConfig fields) apply to a task only, the
    ``text_fields`` a user gave (PrepareConfig field names) to a text corpus only: either given for the
    other kind is an error, never ignored."""
    if config.corpus.startswith(TASK_PREFIX):
        given = [name for name in TEXT_ONLY if name in text_fields]
        if given:
            raise RdepthError(f"{', '.join('--' + k.replace('_', '-') for k in given)} "
                              f"appl{'ies' if len(given) == 1 else 'y'} only to a text "
                              "corpus, not to --corpus task:NAME (a task has its own vocabulary and split)")
    if not config.corpus.startswith(TASK_PREFIX):
        if task_fields:
            raise RdepthError(f"{', '.join('--' + k.replace('_', '-') for k in task_fields)} "
                              "apply only to --corpus task:NAME")
        return prepare_and_describe(config)
    task = TaskDataConfig(task=config.corpus, seed=config.seed, out=config.out, **task_fields)
    return describe_task_data(prepare_task_data(task))

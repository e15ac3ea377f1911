"""Tasks by name, and the ``task:NAME`` / ``task:NAME+NAME`` data specs.

``TASKS`` maps a name to its task class; ``get_task(name, **params)`` builds
one (parameters validated by the class). A mixture is written with ``+``
(``chase+assign``), optionally with integer weights ``chase*3+assign``.
"""

from __future__ import annotations

from rdepth.data.task_vocab import SPEC_PREFIX
from rdepth.errors import RdepthError
from rdepth.tasks.assign import AssignTask
from rdepth.tasks.base import Task
from rdepth.tasks.chase import ChaseTask
from rdepth.tasks.modsum import ModSumTask

TASKS: dict[str, type[Task]] = {
    ChaseTask.name: ChaseTask,
    ModSumTask.name: ModSumTask,
    AssignTask.name: AssignTask,
}


def get_task(name: str, **params) -> Task:
    """The task ``name`` with ``params`` overriding its defaults; RdepthError for an unknown name."""
    if name not in TASKS:
        raise RdepthError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    try:
        return TASKS[name](**params)
    except TypeError:
        raise RdepthError(f"task {name}: unknown parameter(s) {', '.join(sorted(params))}") from None


MAX_WEIGHT = 1e6  # a mixture weight; the ratio of two is what counts, and their sum must stay finite


def parse_mixture(text: str) -> list[tuple[str, float]]:
    """``"chase*3+assign"`` -> [("chase", 3.0), ("assign", 1.0)]; a ``task:`` prefix is allowed."""
    if not isinstance(text, str):
        raise RdepthError(f"task mixture must be a string, got {text!r}")
    body = text[len(SPEC_PREFIX):] if text.startswith(SPEC_PREFIX) else text
    mixture: list[tuple[str, float]] = []
    for part in body.split("+"):
        name, _, weight_text = part.strip().partition("*")
        if name not in TASKS:
            raise RdepthError(f"unknown task {name!r} in {text!r} (choose from {', '.join(TASKS)})")
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise RdepthError(f"task mixture {text!r}: weight {weight_text!r} is not a number") from None
        if not (0 < weight <= MAX_WEIGHT):  # also refuses nan and inf, whose probabilities would be nan
            raise RdepthError(f"task mixture {text!r}: weight {weight_text!r} of {name} must be a positive finite "
                              f"number <= {MAX_WEIGHT:g}")
        if any(name == seen for seen, _ in mixture):
            raise RdepthError(f"task mixture {text!r}: {name} appears twice")
        mixture.append((name, weight))
    return mixture


def task_spec(names: list[str]) -> str:
    """The tokenizer/corpus spec string of a task data set: ``task:chase`` or ``task:chase+assign``."""
    return SPEC_PREFIX + "+".join(names)

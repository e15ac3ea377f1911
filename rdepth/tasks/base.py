"""What every task is: a frozen, validated parameter set that samples problems and checks answers.

A :class:`Problem` is one statement plus its answers, as task-vocabulary ids.
Its ``answer_positions`` index the tokens to be *predicted* (the targets): a
model reading ``tokens[:i]`` should emit ``tokens[i]`` for each such ``i``.
A problem never holds the ``<eot>`` separator; streams add one after each.

A :class:`Task` subclass sets ``name``, ``min_difficulty``, implements
``max_difficulty``, ``length(difficulty)``, ``_generate(rng, difficulty)``
and ``solve(problem_tokens)``. ``solve`` recomputes the answers from the
statement alone (parsing the tokens, never looking at the generator's
answer slots), so ``check`` catches a generator bug. ``answer_hops``, where a
task defines it, recomputes the same way how many sequential steps (hops)
each answer needs: the per-token difficulty that adaptive depth should track.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from rdepth.errors import RdepthError
from rdepth.fields import is_int


@dataclass(frozen=True)
class Problem:
    """One problem. ``tokens``: ids (no ``<eot>``); ``answer_positions``: indices into ``tokens``
    of the answer tokens, increasing; ``answer``: ``tokens`` at those positions."""

    task: str
    difficulty: int
    tokens: tuple[int, ...]
    answer_positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.answer_positions:
            raise RdepthError(f"{self.task} problem has no answer positions")
        if any(not 0 < p < len(self.tokens) for p in self.answer_positions):
            raise RdepthError(f"{self.task} problem: answer position outside 1..{len(self.tokens) - 1}")
        if list(self.answer_positions) != sorted(set(self.answer_positions)):
            raise RdepthError(f"{self.task} problem: answer positions must increase")

    @property
    def answer(self) -> tuple[int, ...]:
        return tuple(self.tokens[p] for p in self.answer_positions)

    @property
    def answer_mask(self) -> np.ndarray:
        """bool [len(tokens)]: True at the answer positions."""
        mask = np.zeros(len(self.tokens), dtype=bool)
        mask[list(self.answer_positions)] = True
        return mask


def check_int(owner: str, field: str, value, low: int, high: int) -> None:
    """RdepthError unless ``value`` is an integer in [low, high]."""
    if not is_int(value) or not low <= value <= high:
        raise RdepthError(f"{owner}: {field} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class Task:
    """Base of every task; subclasses are frozen dataclasses whose fields are the task's parameters."""

    name: ClassVar[str] = "task"
    min_difficulty: ClassVar[int] = 1
    difficulty_meaning: ClassVar[str] = ""

    @property
    def max_difficulty(self) -> int:
        raise NotImplementedError

    def length(self, difficulty: int) -> int:
        """Tokens in a problem of ``difficulty`` (without the separator)."""
        raise NotImplementedError

    def solve(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        """The answers recomputed from the statement part of ``problem_tokens``."""
        raise NotImplementedError

    def answer_hops(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        """Per answer slot, in order, the sequential steps (hops) its answer needs, recomputed from the
        statement part of ``problem_tokens`` like :meth:`solve`; RdepthError for a task that does not
        count them."""
        raise RdepthError(f"task {self.name} does not count the hops of its answers")

    def _generate(self, rng: np.random.Generator, difficulty: int) -> Problem:
        raise NotImplementedError

    # ------------------------------------------------------------ shared checks
    def check_difficulty(self, difficulty: int) -> None:
        """RdepthError unless ``difficulty`` is an integer in this task's range."""
        if not is_int(difficulty) or not self.min_difficulty <= difficulty <= self.max_difficulty:
            raise RdepthError(f"task {self.name}: difficulty {difficulty!r} is out of range "
                              f"[{self.min_difficulty}, {self.max_difficulty}] ({self.difficulty_meaning})")

    def check_fits(self, difficulty: int, block_size: int) -> None:
        """RdepthError unless a problem of ``difficulty`` plus its separator fits ``block_size`` tokens
        (a window of a model with context C holds C + 1 tokens: the separator is only a target)."""
        self.check_difficulty(difficulty)
        needed = self.length(difficulty) + 1
        if needed > block_size:
            raise RdepthError(f"task {self.name}: a difficulty-{difficulty} problem needs {needed} tokens "
                              f"with its separator, more than a window of {block_size}")

    def sample(self, rng: np.random.Generator, difficulty: int) -> Problem:
        """A random problem of ``difficulty`` drawn from ``rng``."""
        self.check_difficulty(difficulty)
        problem = self._generate(rng, int(difficulty))
        assert len(problem.tokens) == self.length(difficulty), "generator and length() disagree"
        return problem

    def check(self, problem_tokens: Sequence[int], predicted_answer: Sequence[int]) -> bool:
        """True when ``predicted_answer`` (ids, one per answer slot) is exactly right."""
        return tuple(int(t) for t in predicted_answer) == self.solve(problem_tokens)

    def describe(self) -> dict:
        """Parameters and difficulty range, for manifests."""
        from dataclasses import asdict

        return {"name": self.name, "params": asdict(self), "min_difficulty": self.min_difficulty,
                "max_difficulty": self.max_difficulty, "difficulty": self.difficulty_meaning}


def malformed(task: str, why: str) -> RdepthError:
    return RdepthError(f"malformed {task} problem: {why}")

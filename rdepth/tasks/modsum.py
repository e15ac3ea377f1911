"""Running sum modulo m: add a list of digits, answer the total mod m.

A problem is ``+ d1 d2 ... dn = r`` with digits ``d_i`` in [0, modulus) and
``r = (d1 + ... + dn) mod modulus``::

    + 3 9 4 1 = 7        (modulus 10, difficulty 4)

The answer needs the running state through every term; **difficulty** =
n, the number of terms (n - 1 additions, each depending on the last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rdepth.data.task_vocab import DIGIT_IDS, EQUALS_ID, PLUS_ID, digit_value
from rdepth.tasks.base import Problem, Task, check_int, malformed


@dataclass(frozen=True)
class ModSumTask(Task):
    """Digits below ``modulus`` (2..10); 1 to ``max_terms`` terms (max_terms in 2..256)."""

    modulus: int = 10
    max_terms: int = 64

    name = "modsum"
    min_difficulty = 1
    difficulty_meaning = "number of terms summed"

    def __post_init__(self) -> None:
        check_int("task modsum", "modulus", self.modulus, 2, len(DIGIT_IDS))
        check_int("task modsum", "max_terms", self.max_terms, 2, 256)

    @property
    def max_difficulty(self) -> int:
        return self.max_terms

    def length(self, difficulty: int) -> int:
        return difficulty + 3

    def _generate(self, rng: np.random.Generator, difficulty: int) -> Problem:
        terms = rng.integers(0, self.modulus, size=difficulty)
        total = int(terms.sum()) % self.modulus
        tokens = [PLUS_ID] + [DIGIT_IDS[int(t)] for t in terms] + [EQUALS_ID, DIGIT_IDS[total]]
        return Problem(self.name, difficulty, tuple(tokens), (len(tokens) - 1,))

    def solve(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        tokens = [int(t) for t in problem_tokens]
        if len(tokens) < 3 or tokens[0] != PLUS_ID or tokens[-2] != EQUALS_ID:
            raise malformed(self.name, "expected '+ digits = answer'")
        total = 0
        for index, token in enumerate(tokens[1:-2], start=1):
            value = digit_value(token)
            if value is None or value >= self.modulus:
                raise malformed(self.name, f"token {index} is not a digit below {self.modulus}")
            total += value
        return (DIGIT_IDS[total % self.modulus],)

    def answer_hops(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        """The terms summed (the difficulty): the running state passes through each."""
        self.solve(problem_tokens)  # the same checks
        return (len(problem_tokens) - 3,)

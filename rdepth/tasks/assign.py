"""Variable-assignment chains: which value does a variable hold?

A problem lists ``variables`` assignments ``x = y`` in random order, where
``y`` is a digit or another variable, each variable assigned exactly once and
no cycles; then ``queries`` queries ``? x v`` with ``v`` the digit ``x``
holds::

    c = b  a = 7  d = 2  b = a   ? c 7  ? d 2        (variables=4, difficulty 3)

Structure: one *main* chain of ``difficulty`` assignments ending in a digit
(``c = b``, ``b = a``, ``a = 7``: 3), the other variables in distractor chains
of at most ``difficulty`` assignments each. The main chain's last variable is
always queried. **Difficulty** = assignments followed from the main query to
its digit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rdepth.data.task_vocab import DIGIT_IDS, EQUALS_ID, QUERY_ID, SYMBOL_IDS, digit_value, is_symbol
from rdepth.tasks.base import Problem, Task, check_int, malformed


@dataclass(frozen=True)
class AssignTask(Task):
    """``variables`` names (1..26), ``queries`` per problem (1..variables)."""

    variables: int = 16
    queries: int = 4

    name = "assign"
    min_difficulty = 1
    difficulty_meaning = "assignments followed from the main query to its digit"

    def __post_init__(self) -> None:
        check_int("task assign", "variables", self.variables, 1, len(SYMBOL_IDS))
        check_int("task assign", "queries", self.queries, 1, self.variables)

    @property
    def max_difficulty(self) -> int:
        return self.variables

    def length(self, difficulty: int) -> int:
        return 3 * self.variables + 3 * self.queries

    def _generate(self, rng: np.random.Generator, difficulty: int) -> Problem:
        names = [int(s) for s in rng.choice(SYMBOL_IDS, size=self.variables, replace=False)]
        chains = [names[:difficulty]]  # chain[0] = digit, chain[i] = chain[i - 1]
        rest = names[difficulty:]
        while rest:
            size = int(rng.integers(1, min(difficulty, len(rest)) + 1))
            chains.append(rest[:size])
            rest = rest[size:]
        source: dict[int, int] = {}
        value: dict[int, int] = {}
        for chain in chains:
            digit = DIGIT_IDS[int(rng.integers(0, len(DIGIT_IDS)))]
            source[chain[0]] = digit
            for previous, name in zip(chain[:-1], chain[1:], strict=False):
                source[name] = previous
            value.update({name: digit for name in chain})

        tokens: list[int] = []
        for index in rng.permutation(self.variables):
            tokens += [names[index], EQUALS_ID, source[names[index]]]
        main = chains[0][-1]
        others = rng.choice([n for n in names if n != main], size=self.queries - 1, replace=False)
        targets = [main] + [int(n) for n in others]
        positions = []
        for index in rng.permutation(self.queries):
            tokens += [QUERY_ID, targets[index], value[targets[index]]]
            positions.append(len(tokens) - 1)
        return Problem(self.name, difficulty, tuple(tokens), tuple(positions))

    def solve(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(digit for digit, _ in self._lookups(problem_tokens))

    def answer_hops(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        """Per query, the assignments followed from its variable to the digit (the main query's equals
        the difficulty)."""
        return tuple(hops for _, hops in self._lookups(problem_tokens))

    def _lookups(self, problem_tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Per query of the statement, (digit, assignments followed) recomputed from the assignments."""
        tokens = [int(t) for t in problem_tokens]
        source: dict[int, int] = {}
        index = 0
        while index < len(tokens) and tokens[index] != QUERY_ID:
            statement = tokens[index:index + 3]
            if len(statement) != 3 or not is_symbol(statement[0]) or statement[1] != EQUALS_ID \
                    or not (is_symbol(statement[2]) or digit_value(statement[2]) is not None):
                raise malformed(self.name, f"expected 'name = name-or-digit' at token {index}")
            if statement[0] in source:
                raise malformed(self.name, f"variable id {statement[0]} is assigned twice")
            source[statement[0]] = statement[2]
            index += 3
        answers = []
        while index < len(tokens):
            query = tokens[index:index + 3]
            if len(query) != 3 or query[0] != QUERY_ID:
                raise malformed(self.name, f"expected '? name value' at token {index}")
            answers.append(_value_of(source, query[1], self.name))
            index += 3
        if not answers:
            raise malformed(self.name, "no query")
        return answers


def _value_of(source: dict[int, int], name: int, task: str) -> tuple[int, int]:
    """Follow assignments from ``name`` to the digit it holds: (the digit, assignments followed)."""
    current = name
    for hops in range(len(source) + 1):
        if digit_value(current) is not None:
            return current, hops
        if current not in source:
            raise malformed(task, f"variable id {current} is never assigned")
        current = source[current]
    raise malformed(task, f"the assignments from variable id {name} form a cycle")

"""Pointer chasing to a fixed point: follow a function's arrows from a start symbol until it stops.

A problem lists a function f on ``nodes`` distinct symbols as ``nodes`` pairs
``x f(x)`` in random order, then ``queries`` queries ``? s a`` where the answer
``a`` is the fixed point reached from ``s`` (the first ``x`` on the path with
f(x) = x). The number of hops is never written, so deeper instances than
those seen in training are the same kind of problem::

    c d  a b  d d  b c  e e   ? a d  ? e e        (nodes=5, difficulty 3)

With ``ordered=True`` the symbols are the first ``nodes`` letters and only the
values are listed, in alphabetical order of their arguments (``f(a) f(b) ...``),
so a lookup is by position in the problem rather than by matching the pair's
first symbol (easier to learn; the problem must start where the model expects)::

    b c d d e   ? a d  ? e e                      (nodes=5, ordered, difficulty 3)

Structure: one *main* chain of ``difficulty`` hops s -> ... -> t with f(t) = t,
and the other symbols in distractor chains of at most ``difficulty`` hops
(at most ``max_distractor_hops`` when set, at least ``min_distractor_hops`` while
enough symbols remain), each ending in its own fixed point.
Fixed points are visible locally (f(x) = x), so guessing one of them is a
shortcut whose success grows as the main chain uses up the symbols and fewer
chains remain; shorter distractor chains leave more fixed points to choose from, and
distractors much shorter than the main chain give it away (a query whose path is longer
than any distractor's must end where the main chain does): ``min_distractor_hops`` equal to
the difficulty makes the distractor chains as long as the main one while enough symbols remain
(the last one takes what is left: 16 nodes at difficulty 4 give chains of 5, 5, 5 and 1 symbols),
so that following the arrows is what answers. The main chain's start is always one of
the queries; the others start anywhere else. **Difficulty** = hops on the
main chain = the sequential lookups its answer needs (the other queries need
at most as many).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rdepth.data.task_vocab import QUERY_ID, SYMBOL_IDS, is_symbol
from rdepth.errors import RdepthError
from rdepth.tasks.base import Problem, Task, check_int, malformed


@dataclass(frozen=True)
class ChaseTask(Task):
    """``nodes`` symbols (2..26), ``queries`` per problem (1..nodes), ``ordered`` listing and
    ``max_distractor_hops`` (see above)."""

    nodes: int = 20
    queries: int = 6
    ordered: bool = False
    max_distractor_hops: int | None = None  # None: up to the difficulty
    min_distractor_hops: int = 0  # distractor chains get at least min(this, difficulty, what is left) hops

    name = "chase"
    min_difficulty = 1
    difficulty_meaning = "hops from the main query to its fixed point"

    def __post_init__(self) -> None:
        check_int("task chase", "nodes", self.nodes, 2, len(SYMBOL_IDS))
        check_int("task chase", "queries", self.queries, 1, self.nodes)
        if self.max_distractor_hops is not None:
            check_int("task chase", "max_distractor_hops", self.max_distractor_hops, 0, self.nodes)
        check_int("task chase", "min_distractor_hops", self.min_distractor_hops, 0, self.nodes)
        if self.max_distractor_hops is not None and self.min_distractor_hops > self.max_distractor_hops:
            raise RdepthError("task chase: min_distractor_hops must not exceed max_distractor_hops")
        if not isinstance(self.ordered, bool):
            raise RdepthError(f"task chase: ordered must be true or false, got {self.ordered!r}")

    @property
    def max_difficulty(self) -> int:
        return self.nodes - 1  # the main chain holds difficulty + 1 symbols

    def length(self, difficulty: int) -> int:
        return (1 if self.ordered else 2) * self.nodes + 3 * self.queries

    def _generate(self, rng: np.random.Generator, difficulty: int) -> Problem:
        pool = SYMBOL_IDS[: self.nodes] if self.ordered else SYMBOL_IDS
        symbols = [int(s) for s in rng.choice(pool, size=self.nodes, replace=False)]
        successor: dict[int, int] = {}
        chains = [symbols[: difficulty + 1]]
        rest = symbols[difficulty + 1:]
        longest = difficulty if self.max_distractor_hops is None else min(difficulty, self.max_distractor_hops)
        shortest = min(self.min_distractor_hops, longest)
        while rest:  # distractor chains of shortest + 1 .. longest + 1 symbols (fewer at the end)
            size = int(rng.integers(min(shortest + 1, len(rest)), min(longest + 1, len(rest)) + 1))
            chains.append(rest[:size])
            rest = rest[size:]
        for chain in chains:
            for source, target in zip(chain[:-1], chain[1:], strict=False):
                successor[source] = target
            successor[chain[-1]] = chain[-1]
        ends = {symbol: chain[-1] for chain in chains for symbol in chain}

        tokens: list[int] = []
        if self.ordered:
            tokens += [successor[symbol] for symbol in SYMBOL_IDS[: self.nodes]]
        else:
            for index in rng.permutation(self.nodes):
                tokens += [symbols[index], successor[symbols[index]]]
        others = rng.choice(symbols[1:], size=self.queries - 1, replace=False)
        starts = [symbols[0]] + [int(s) for s in others]
        positions = []
        for index in rng.permutation(self.queries):
            tokens += [QUERY_ID, starts[index], ends[starts[index]]]
            positions.append(len(tokens) - 1)
        return Problem(self.name, difficulty, tuple(tokens), tuple(positions))

    def solve(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(end for end, _ in self._paths(problem_tokens))

    def answer_hops(self, problem_tokens: Sequence[int]) -> tuple[int, ...]:
        """Per query, the arrows followed from its start to the fixed point (0 when the start is one;
        the main query's equals the difficulty)."""
        return tuple(hops for _, hops in self._paths(problem_tokens))

    def _paths(self, problem_tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Per query of the statement, (fixed point, hops) recomputed from the listed function."""
        tokens = [int(t) for t in problem_tokens]
        successor: dict[int, int] = {}
        index = 0
        if self.ordered:
            values = tokens[: tokens.index(QUERY_ID)] if QUERY_ID in tokens else tokens
            if len(values) != self.nodes or not all(SYMBOL_IDS[0] <= t < SYMBOL_IDS[0] + self.nodes for t in values):
                raise malformed(self.name, f"expected {self.nodes} values among the first {self.nodes} letters")
            successor = dict(zip(SYMBOL_IDS[: self.nodes], values, strict=False))
            index = self.nodes
        while not self.ordered and index < len(tokens) and tokens[index] != QUERY_ID:
            pair = tokens[index:index + 2]
            if len(pair) != 2 or not all(is_symbol(t) for t in pair):
                raise malformed(self.name, f"expected a pair of symbols at token {index}")
            if pair[0] in successor:
                raise malformed(self.name, f"symbol id {pair[0]} has two arrows")
            successor[pair[0]] = pair[1]
            index += 2
        paths = []
        while index < len(tokens):
            query = tokens[index:index + 3]
            if len(query) != 3 or query[0] != QUERY_ID:
                raise malformed(self.name, f"expected '? start answer' at token {index}")
            paths.append(_fixed_point(successor, query[1], self.name))
            index += 3
        if not paths:
            raise malformed(self.name, "no query")
        return paths


def _fixed_point(successor: dict[int, int], start: int, task: str) -> tuple[int, int]:
    """Follow ``successor`` from ``start`` until a symbol maps to itself: (that symbol, arrows followed)."""
    current = start
    for hops in range(len(successor) + 1):
        if current not in successor:
            raise malformed(task, f"symbol id {current} has no arrow")
        following = successor[current]
        if following == current:
            return current, hops
        current = following
    raise malformed(task, f"the path from symbol id {start} cycles without a fixed point")

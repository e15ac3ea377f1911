"""Loop speculation through the engine: at low load, a request drafts with few loop steps and the engine's
budget verifies the drafts in one pass, on the request's own slot.

At low occupancy a tick pays the loop budget for one token per row. :class:`SpeculatingTick` is the eager tick
(:class:`~rdepth.engine.eager.EagerTick`) with one addition: when at most ``at_most`` slots are occupied, a row
whose token has just entered (it is about to start its way through the stages), whose request decodes at the
engine's own depth (greedily; sampled: below) and is at or past the last position of its prompt, runs one round of the one
decoder's loop speculation (:func:`rdepth.model.loop_speculation.speculation_round`) instead of its plain tick:
K tokens drafted at D loop steps per group (or the engine's exit rule capped at D), the entering token and the
drafts verified in one lock-step pass at the engine's budget or rule, the longest agreeing prefix kept and the
verifier's own token after it. The round runs on a batch-1 :class:`~rdepth.model.decoder.Decoder` pointed at
the slot's row of the engine's cache (:meth:`KVCache.row`: views, so every key it writes lands in the slot)
and at the slot's initial states (the request's own draws), from the row's position
(:meth:`Decoder.attach`).

The round's decided positions are handed to the scheduler as readouts of the same tick, in order
(``TickOutput.following``; ``TickOutput.speculation`` says they are not ticks): each with the verifier's logits,
its loop steps per group and its token, the drafts already entered (the verifying pass computed them), the
verifier's own token fed by the scheduler as any other; a request that ends on one of them (a stop token, its
length) drops the later ones, so no token past its end is emitted. The slot is then what plain decoding leaves:
its positions hold the verifying pass's keys (the latest-KV rule for tokens that stopped early included:
written through to the later step slots as they are computed), the drafts' keys past them are overwritten
before any later token reads them, and the next token is the verifier's.

*A sampled request* speculates with rejection sampling (the verifier's distribution exactly: drafts drawn from
the request's own generator, each kept with probability min(1, p/q), a rejected one replaced by a draw from
max(p - q, 0), as the one decoder's rounds do), and only where every tick may run rounds (``at_most`` at least
the engine's width): its tokens are then its batch-1 speculative decode's
(:func:`~rdepth.model.loop_speculation.speculative_decode`, the acceptance draws seeded ``seed + 1``), whatever
shares the batch. Rounds drawn in another order than plain sampling's, coming and going with the load, would make
its tokens depend on what else is in flight; with a smaller ``at_most`` it decodes plainly.

*How a draft reads the cache*: at loop step k a draft attends to the step-k slots of the earlier positions, which
hold the verifier's keys (its step-k key, or the latest key of a token that stopped before k), and the round's
earlier drafts' own; a draft is the D-step continuation of the verified sequence (see
:mod:`rdepth.model.loop_speculation`). Rows that bring a depth of their own, that are in their prompt, or
that have fewer than two tokens left decode plainly (and sampled rows, above); so does every row of a tick with
more than ``at_most`` slots occupied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rdepth.engine.eager import FREE, EagerTick
from rdepth.engine.tick import TickInput, TickOutput, TickPlan
from rdepth.errors import RdepthError
from rdepth.model.budget import resolve_budget
from rdepth.model.decoder import Decoder
from rdepth.model.kv import KVCache
from rdepth.model.loop_speculation import Round, Sampling, draft_budget, speculation_round
from rdepth.model.recurrent import RecurrentLM


@dataclass(frozen=True)
class Speculation:
    """``tokens`` K drafts a round at ``draft_loops`` D loop steps per group (N, or one per group), while at most
    ``at_most`` slots are occupied."""

    tokens: int
    draft_loops: Sequence[int] | int | str = 1
    at_most: int = 1

    def __post_init__(self) -> None:
        for name in ("tokens", "at_most"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                shown = "speculate (K drafts a round)" if name == "tokens" else "speculate_at_most"
                raise RdepthError(f"engine: {shown} must be an integer >= 1, got {value!r}")


def speculating_tick(model: RecurrentLM, plan: TickPlan, tick: str, speculation: Speculation,
                     loop_counts, controller_factory: Callable | None) -> SpeculatingTick:
    """The eager tick with loop speculation for ``plan`` (the engine's budget: ``loop_counts`` or
    ``controller_factory``); one-line errors for what it cannot run."""
    if tick != "eager":
        raise RdepthError(f"engine: loop speculation runs on the eager tick, not {tick!r}")
    if plan.kv_layout != "exact" or plan.warm_start:
        raise RdepthError("engine: loop speculation needs the exact key/value layout without warm start (the "
                          "verifier recomputes positions from the cache's step slots)")
    verify = resolve_budget(model, loop_counts, controller_factory)
    draft = draft_budget(model, verify, speculation.draft_loops)  # (errors: no loops, no cap, nothing to draft)
    return SpeculatingTick(model, plan, speculation, Decoder(
        model, 1, loop_counts=verify.counts, controller_factory=verify.controller_factory, capacity=plan.capacity),
        draft)


def accept_generator(generator: torch.Generator, seed: int) -> torch.Generator:
    """The acceptance draws of a sampling request whose tokens come from ``generator`` (seeded ``seed``): a
    generator of their own, seeded ``seed + 1``, as :func:`~rdepth.model.loop_speculation.speculative_decode`
    seeds them, so a request's tokens are the batch-1 speculative decode's."""
    return torch.Generator(device=generator.device).manual_seed(int(seed) + 1)


def count_speculation(stats, rounds: np.ndarray) -> None:
    """``stats`` (the engine's :class:`~rdepth.engine.scheduler.EngineStats`) count a tick's ``rounds`` (``[R, 3]``:
    row, drafts made, drafts kept), drafts made and drafts kept."""
    stats.speculated_ticks += 1
    stats.rounds += len(rounds)
    stats.drafted += int(rounds[:, 1].sum())
    stats.accepted += int(rounds[:, 2].sum())


class SpeculatingTick(EagerTick):
    """The eager tick with loop-speculation rounds at low occupancy (see the module)."""

    def __init__(self, model: RecurrentLM, plan: TickPlan, speculation: Speculation, decoder: Decoder, draft):
        super().__init__(model, plan)
        self.speculation, self.decoder, self.draft = speculation, decoder, draft
        self.requests: list = [None] * plan.batch  # each slot's request (admitted)
        # A sampled request's rounds draw its tokens in another order than plain sampling: it speculates only where
        # every tick may (at_most >= the width), so that whether it does never depends on what shares the batch
        self.sampled_rounds = speculation.at_most >= plan.batch
        # each sampling slot's draws: its request's generator (the scheduler's) and the acceptance draws' own
        self.draws: list[tuple[torch.Generator, torch.Generator] | None] = [None] * plan.batch
        self._row_caches: dict[int, KVCache] = {}

    def __call__(self, tick_input: TickInput) -> TickOutput:
        self._apply(tick_input)
        for row, request in tick_input.admitted:
            self.requests[row] = request
            generator = tick_input.generators.get(row) if self.sampled_rounds else None
            self.draws[row] = None if generator is None else (generator, accept_generator(generator, request.seed))
        rounds = []
        if tick_input.entering.size and int(tick_input.live.sum()) <= self.speculation.at_most:
            rounds = self._rounds(tick_input)
        output = self._walk()  # (the rows that ran a round are out of the walk: their stage is FREE)
        return self._with_rounds(output, rounds) if rounds else output

    def _rounds(self, tick_input: TickInput) -> list[tuple[int, int, Round]]:
        """A round for each row entering a token that may speculate: ``(row, drafts made, round)``."""
        done = []
        for row in np.unique(tick_input.entering).tolist():
            request = self.requests[row]
            position, length = int(self.position[row]), len(request.prompt)
            total = min(length + request.max_tokens, self.capacity + 1)  # the sequence's length at most
            left = total - position - 1  # tokens still to choose after the one entering
            sampled = request.temperature > 0
            # (a sampled request's rounds as the batch-1 rounds run: its first token drawn from its prompt's readout,
            # a round for the last token too)
            first, least = (length, 1) if sampled else (length - 1, 2)
            if (sampled and self.draws[row] is None) or request.depth is not None or position < first or left < least:
                continue
            count = min(self.speculation.tokens, left)
            token = int(tick_input.tokens[tick_input.entering == row][-1])
            decoder = self.decoder
            decoder.attach(self._row_cache(row), {group: table.narrow(0, row, 1)
                                                  for group, table in self.initial.items()}, position)
            sampling, rng, accept_rng = Sampling(), None, None
            if sampled:  # (rejection sampling: the verifier's distribution, drawn from the request's generator)
                sampling = Sampling(request.temperature, request.top_k, request.top_p)
                rng, accept_rng = self.draws[row]
            one = speculation_round(decoder, token, count, position + 1 + count < total, self.draft, sampling, rng,
                                    accept_rng)
            self.stage[row] = FREE  # (its next token is the verifier's, fed by the scheduler as any other)
            done.append((row, count, one))
        return done

    def _row_cache(self, row: int) -> KVCache:
        if row not in self._row_caches:
            self._row_caches[row] = self.slots.cache.row(row)
        return self._row_caches[row]

    def _with_rounds(self, output: TickOutput, rounds: list[tuple[int, int, Round]]) -> TickOutput:
        """``output`` with the rounds' readouts following it (the j-th of every round together) and their loop
        steps counted."""
        groups = self.model.n_groups
        later = []
        for j in range(max(one.decided for _, _, one in rounds)):
            here = [(row, one) for row, _, one in rounds if one.decided > j]
            logits = torch.stack([one.verified[j] for _, one in here])
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            # the round's own token there (a kept draft, or the verifier's), -1 where the logits are not finite
            greedy = [(one.drafts[j] if j < one.kept else one.token) if ok else -1
                      for (_, one), ok in zip(here, finite, strict=True)]
            entered = [one.drafts[j] if j < one.decided - 1 else -1 for _, one in here]  # (drafts: computed)
            steps = np.asarray([one.steps[:, j].tolist() for _, one in here], dtype=np.int64).reshape(-1, groups)
            later.append(TickOutput(np.asarray([row for row, _ in here], dtype=np.int64),
                                    np.asarray(greedy, dtype=np.int64), steps, logits, np.arange(len(here)),
                                    [0] * groups, entered=np.asarray(entered, dtype=np.int64),
                                    decided=np.ones(len(here), dtype=bool)))  # (the round chose each token)
        for _, _, one in rounds:
            for group, steps in enumerate((one.draft_steps + one.steps.sum(dim=1)).tolist()):
                output.loop_steps[group] += int(steps)
        output.following = later + output.following
        output.speculation = np.asarray([(row, count, one.kept) for row, count, one in rounds], dtype=np.int64)
        return output

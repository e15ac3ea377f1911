"""The engine's host side: slots, the queue, admission, retirement, the host logs and token choice.

:class:`Scheduler` hands the tick a :class:`~rdepth.engine.tick.TickInput` (:meth:`Scheduler.schedule`) and reads
its :class:`~rdepth.engine.tick.TickOutput` back (:meth:`Scheduler.update`): for each row read out, its steps and
argmax recorded; in its prompt, the prompt's next token fed; beyond it, the next token chosen (greedy, or drawn
with the request's own generator), handed to the listener, and the request retired (a stop token, its length,
the context, a non-finite output) or its token fed; a cancelled request ends between ticks, queued or in a slot.
It touches no device buffer of the tick's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from rdepth.engine.request import Finished, Request, TokenLogprob
from rdepth.engine.tick import TickInput, TickOutput
from rdepth.model.sampling import choose_tokens


@dataclass
class EngineStats:
    """Counters over the engine's life: ticks, row-steps per group (loop steps computed, summed over rows),
    positions decoded, occupied slot-ticks (occupancy = that over ticks * batch)."""

    ticks: int = 0
    positions: int = 0
    occupied: int = 0
    loop_steps: list[int] | None = None
    requests: int = 0
    failed: int = 0
    # loop speculation (Engine(speculate=K)): ticks that ran a round, verification rounds, drafts made and kept
    speculated_ticks: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self, batch: int) -> dict:
        steps = self.loop_steps or []
        return {"ticks": self.ticks, "positions": self.positions, "requests": self.requests,
                "failed": self.failed, "loop_steps": list(steps),
                "mean_loop_steps": [s / self.positions if self.positions else 0.0 for s in steps],
                "occupancy": self.occupied / (self.ticks * batch) if self.ticks else 0.0,
                "speculation": {"ticks": self.speculated_ticks, "rounds": self.rounds, "drafted": self.drafted,
                                "accepted": self.accepted,
                                "acceptance": self.accepted / self.drafted if self.drafted else 0.0}}


class _Live:
    """A request in a slot: what it has chosen so far (its loop steps and predictions per position are in the
    host logs, :class:`_Logs`, until it retires)."""

    def __init__(self, request_id: int, request: Request, result: Finished, device: torch.device):
        self.id, self.request, self.result = request_id, request, result
        self.generator = None
        if request.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(int(request.seed))
        self.logits: list[torch.Tensor] = []


class _Logs:
    """Per slot, on the host: the prompt, the loop steps per group of every position read out, and the argmax
    after each; one vectorized write per readout for all its rows, turned into the result's lists once, when
    the request retires."""

    def __init__(self, batch: int, capacity: int, n_groups: int, k_max: list[int], fixed: bool):
        # (int32: token ids and loop steps fit, and a long context's slots take half the host memory)
        self.prompt = np.zeros((batch, capacity), dtype=np.int32)  # the prompt (then zeros)
        self.prompt_length = np.zeros(batch, dtype=np.int64)
        self.keeps = np.zeros(batch, dtype=bool)  # whether the slot's request keeps its logits (or prompt logprobs)
        self.steps = np.zeros((batch, capacity, n_groups), dtype=np.int32)  # per position read out
        self.predicted = np.zeros((batch, capacity), dtype=np.int32)  # the argmax after each position
        # per slot: whether its request runs a fixed budget, and the most steps each group may take (its depth)
        self.caps = np.tile(np.asarray(k_max, dtype=np.int64), (batch, 1))
        self.fixed = np.full(batch, fixed, dtype=bool)
        self.engine_caps, self.engine_fixed = np.asarray(k_max, dtype=np.int64), fixed

    def admit(self, row: int, request: Request) -> None:
        self.prompt[row, :len(request.prompt)] = request.prompt
        self.prompt_length[row] = len(request.prompt)
        self.keeps[row] = request.keep_logits or request.prompt_logprobs  # read per row in the prompt too
        depth = request.depth
        if depth is None:
            self.caps[row], self.fixed[row] = self.engine_caps, self.engine_fixed
        elif depth.loops is not None:
            self.caps[row], self.fixed[row] = depth.loops, True
        else:
            self.caps[row] = np.minimum(self.engine_caps, depth.k_max or self.engine_caps.max())
            self.fixed[row] = False

    def record(self, rows: np.ndarray, positions: np.ndarray, steps: np.ndarray, greedy: np.ndarray) -> None:
        """Rows ``rows`` read out position ``positions`` after loop steps ``steps`` ``[E, G]``, argmax ``greedy``."""
        self.steps[rows, positions] = steps
        self.predicted[rows, positions] = greedy

    def rules(self, row: int, steps: np.ndarray) -> list:
        """Why each loop of slot ``row`` ended, for loop steps ``steps`` ``[..., G]``: "budget" (a fixed budget or
        the cap) or "rule"."""
        return np.where(self.fixed[row] | (steps == self.caps[row]), "budget", "rule").tolist()

    def fill(self, result: Finished, row: int, read: int) -> None:
        """The result's steps, rules and predictions of the ``read`` positions row ``row`` read out."""
        steps = self.steps[row, :read]
        result.steps = steps.tolist()
        result.rules = self.rules(row, steps)
        result.predicted = self.predicted[row, :min(read, int(self.prompt_length[row]))].tolist()


class Scheduler:
    """The host side of an engine of ``batch`` slots of ``capacity`` positions (see the module)."""

    def __init__(self, batch: int, capacity: int, n_groups: int, k_max: list[int], fixed: bool,
                 device: torch.device, clock: Callable[[], float] = time.perf_counter,
                 listener: Callable[[int, int, list[int], list[str], TokenLogprob | None], None] | None = None):
        self.batch, self.capacity, self.device, self.clock, self.listener = batch, capacity, device, clock, listener
        self.live: list[_Live | None] = [None] * batch
        self.taken = np.zeros(batch, dtype=bool)  # the slots a request holds (live's rows that are not None)
        self.position = np.zeros(batch, dtype=np.int64)  # where each slot's token in flight writes
        self.queue: deque[tuple[int, Request, float, int]] = deque()
        self.next_id = 0
        self.cancelled: set[int] = set()
        self.stats = EngineStats(loop_steps=[0] * n_groups)
        self.logs = _Logs(batch, capacity, n_groups, k_max, fixed)
        self._retired: list[int] = []  # slots emptied since the last hand-over
        self._admitted: list[tuple[int, Request]] = []
        # (slots, tokens, positions) fed since the last hand-over
        self._feeding: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._sampling = 0  # the requests in slots that sample their tokens (none: a tick may run ahead)

    # ------------------------------------------------------------------ clients
    def add(self, request: Request) -> int:
        request_id = self.next_id
        self.next_id += 1
        self.queue.append((request_id, request, self.clock(), self.stats.ticks))
        return request_id

    def occupied(self) -> np.ndarray:
        return self.taken.copy()

    def in_flight(self) -> int:
        return int(self.taken.sum())

    def pending(self) -> bool:
        return bool(self.queue) or self.in_flight() > 0

    # ------------------------------------------------------------------ schedule
    def admit(self) -> list[Finished]:
        """End the cancelled requests (:meth:`drop_cancelled`), then fill free slots from the queue; a request
        that cannot run finishes at once with its error."""
        finished = self.drop_cancelled() if self.cancelled else []
        free = np.flatnonzero(~self.taken).tolist()
        while free and self.queue:
            request_id, request, submitted, tick = self.queue.popleft()
            result = Finished(request_id, request, submitted_tick=tick, submitted_s=submitted)
            self.stats.requests += 1
            if len(request.prompt) > self.capacity:
                result.finish_reason, result.error = "error", (
                    f"a prompt of {len(request.prompt)} tokens exceeds the engine's capacity {self.capacity} "
                    "(the model's context)")
                self.stats.failed += 1
                result.finished_tick, result.finished_s = self.stats.ticks, self.clock()
                finished.append(result)
                continue
            row = free.pop(0)
            self.live[row] = _Live(request_id, request, result, self.device)
            self._sampling += self.live[row].generator is not None
            self.taken[row] = True
            self.logs.admit(row, request)
            self.position[row] = 0
            self._admitted.append((row, request))
            self._feeding.append((np.asarray([row]), np.asarray([request.prompt[0]]), np.zeros(1, dtype=np.int64)))
        return finished

    def drop_cancelled(self) -> list[Finished]:
        """The cancelled requests end now, ``finish_reason`` "cancelled": a queued one leaves the queue, one in
        a slot frees it between ticks (in its prompt or mid-loop: the position in flight is dropped, never read
        out), so a waiting request takes the slot in this tick. Ids unknown or finished are forgotten."""
        finished = []
        if self.queue:
            kept = deque()
            for entry in self.queue:
                if entry[0] in self.cancelled:
                    request_id, request, submitted, tick = entry
                    result = Finished(request_id, request, finish_reason="cancelled", submitted_tick=tick,
                                      submitted_s=submitted, finished_tick=self.stats.ticks, finished_s=self.clock())
                    self.stats.requests += 1
                    finished.append(result)
                else:
                    kept.append(entry)
            self.queue = kept
        dropped = [row for row, live in enumerate(self.live) if live is not None and live.id in self.cancelled]
        for row in dropped:
            finished.append(self.retire(row, "cancelled", read_current=False))
        if dropped:  # their tokens fed since the last tick go in nowhere
            self._feeding = [(rows[keep], tokens[keep], positions[keep]) for rows, tokens, positions in self._feeding
                             for keep in [~np.isin(rows, dropped)]]
        self.cancelled.clear()
        return finished

    def schedule(self) -> TickInput:
        """The next tick's hand-over (and the counts of a tick: the caller ticks only with a slot occupied)."""
        live = self.occupied()
        if self._feeding:
            rows, tokens, positions = (np.concatenate(parts).astype(np.int64) for parts in zip(*self._feeding, strict=True))
            order = np.argsort(rows, kind="stable")  # slots in order (every slot entering: views, no gathers)
            rows, tokens, positions = rows[order], tokens[order], positions[order]
        else:
            rows = tokens = positions = np.zeros(0, dtype=np.int64)
        generators = {row: self.live[row].generator for row, _ in self._admitted
                      if self.live[row] is not None and self.live[row].generator is not None}
        tick_input = TickInput(live, np.asarray(self._retired, dtype=np.int64), self._admitted, rows, tokens,
                               positions, greedy_only=self._sampling == 0, generators=generators)
        self._retired, self._admitted, self._feeding = [], [], []
        return tick_input

    def count_rounds(self, rounds: np.ndarray) -> None:
        """Each request its own loop-speculation rounds of a tick (``[R, 3]``: row, drafts made, drafts kept)."""
        for row, drafted, kept in rounds.tolist():
            result = self.live[row].result
            result.rounds, result.drafted, result.accepted = (result.rounds + 1, result.drafted + drafted,
                                                              result.accepted + kept)

    def count_tick(self, occupied: int) -> None:
        self.stats.ticks += 1
        self.stats.occupied += occupied

    # ------------------------------------------------------------------ update
    def update(self, output: TickOutput) -> list[Finished]:
        """Rows read out: records, the next token, retire or go on (see the module). Rows still in their prompt
        (the argmax recorded, the prompt's next token fed) are handled for all of them at once; a row that
        generates, keeps its logits or fails goes through :meth:`_choose`."""
        for group, steps in enumerate(output.loop_steps):
            self.stats.loop_steps[group] += steps
        rows, greedy = output.rows, output.greedy
        if not rows.size:
            return []
        if not self.taken[rows].all():  # (a call that ran ahead: requests that ended in one of its earlier ticks)
            held = self.taken[rows]
            output = replace(output, rows=rows[held], greedy=greedy[held], steps=output.steps[held],
                             index=output.index[held],
                             entered=None if output.entered is None else output.entered[held],
                             decided=None if output.decided is None else output.decided[held])
            rows, greedy = output.rows, output.greedy
            if not rows.size:
                return []
        logs = self.logs
        positions = self.position[rows]
        finite = greedy >= 0
        in_prompt = finite & (positions + 1 < logs.prompt_length[rows])
        keeps = logs.keeps[rows]
        if (in_prompt > keeps).all():  # every row in its prompt (so finite), none keeping logits: nothing per row
            logs.record(rows, positions, output.steps, greedy)
            self.stats.positions += rows.size
            self._feed(rows, logs.prompt[rows, positions + 1], output.entered)
            return []
        if finite.all():
            logs.record(rows, positions, output.steps, greedy)
            read = rows.size
        else:
            logs.record(rows[finite], positions[finite], output.steps[finite], greedy[finite])
            read = int(finite.sum())
        self.stats.positions += read
        feed = in_prompt.copy()
        tokens = logs.prompt[rows, np.minimum(positions + 1, self.capacity - 1)]  # the prompt's next (in it)
        finished = []
        for index in np.flatnonzero(~in_prompt | keeps).tolist():
            decided = output.decided is not None and bool(output.decided[index])
            token = self._choose(int(rows[index]), int(positions[index]), int(greedy[index]), output.logits,
                                 int(output.index[index]), bool(in_prompt[index]), finished, decided)
            if token is not None:
                feed[index], tokens[index] = True, token
        if feed.any():
            self._feed(rows[feed], tokens[feed], None if output.entered is None else output.entered[feed])
        return finished

    def _feed(self, rows: np.ndarray, tokens: np.ndarray, entered: np.ndarray | None = None) -> None:
        """The next token of each row goes in at the row's next position (in the next tick's hand-over), unless
        the tick entered that token there itself (``entered``: the token it entered per row; None: none)."""
        self.position[rows] += 1
        tokens = np.asarray(tokens, dtype=np.int64)
        if entered is not None:
            other = tokens != entered
            if not other.any():
                return
            rows, tokens = rows[other], tokens[other]
        self._feeding.append((rows.copy(), tokens, self.position[rows]))

    def _choose(self, row: int, position: int, greedy: int, logits: torch.Tensor, index: int, in_prompt: bool,
                finished: list[Finished], decided: bool = False) -> int | None:
        """One row's readout beyond the prompt's bookkeeping: its logits kept, its new token chosen (``greedy``
        where the tick ``decided`` it) and handed to the listener, its end; returns the token to feed next, or
        None (retired, or still in the prompt: the caller feeds the prompt's next)."""
        live = self.live[row]
        result, request = live.result, live.request
        if greedy < 0:
            finished.append(self.fail(row, f"the model's output is not finite at position {position}"))
            return None
        if request.keep_logits:
            kept = logits[index].detach().to("cpu", copy=True)  # (a tick may reuse its buffer: the graph tick)
            live.logits.append(kept.float() if kept.dtype in (torch.float16, torch.bfloat16) else kept)
        if in_prompt:
            if request.prompt_logprobs:  # the prompt's next token, scored
                following = int(self.logs.prompt[row, position + 1])
                result.prompt_logprobs.append(TokenLogprob.of(logits[index], following, request.logprobs))
            return None
        token = greedy if live.generator is None or decided else int(choose_tokens(
            logits[index:index + 1], request.temperature, request.top_k, live.generator, request.top_p))
        result.tokens.append(token)
        scored = None
        if request.logprobs is not None:
            scored = TokenLogprob.of(logits[index], token, request.logprobs)
            result.logprobs.append(scored)
        if self.listener is not None:
            steps = self.logs.steps[row, position]
            self.listener(live.id, token, steps.tolist(), self.logs.rules(row, steps), scored)
        reason = None
        if token in request.stop:
            reason = "stop"
        elif len(result.tokens) >= request.max_tokens:
            reason = "length"
        elif position + 1 >= self.capacity:
            reason = "context"
        if reason is not None:
            finished.append(self.retire(row, reason))
            return None
        return token

    # ------------------------------------------------------------------ slots
    def retire(self, row: int, reason: str, error: str | None = None, read_current: bool | None = None) -> Finished:
        """Slot ``row``'s request ends: after its current position read out, or (``error``, or ``read_current``
        False: a cancellation between ticks) before it."""
        live = self.live[row]
        result = live.result
        read_current = error is None if read_current is None else read_current
        self.logs.fill(result, row, int(self.position[row]) + read_current)
        result.finish_reason, result.error = reason, error
        if live.logits:
            result.logits = torch.stack(live.logits)
        result.finished_tick, result.finished_s = self.stats.ticks, self.clock()
        self._sampling -= live.generator is not None
        self.live[row] = None
        self.taken[row] = False
        self._retired.append(row)
        return result

    def fail(self, row: int, why: str) -> Finished:
        self.stats.failed += 1
        return self.retire(row, "error", why)
